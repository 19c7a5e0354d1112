"""Small constructors over the IR nodes (``lit``, ``seq``, ``alt``...), so front ends read like
grammars, and the pre-order :func:`walk`. Re-exported by :mod:`agent_infer.grammar.ir`."""

from __future__ import annotations

from collections.abc import Iterator

from agent_infer.grammar.ir.nodes import Alt, CharClass, Empty, Expr, Literal, Repeat, Seq

_SHORT_LITERALS: dict[str, Literal] = {}
_EMPTY = Empty()


def lit(text: str) -> Expr:
    """A literal, or Empty for the empty string."""
    # Punctuation and keywords ('"', ':', ',', "null"...) are asked for thousands of times per
    # large schema: one shared node each (nodes are immutable).
    node = _SHORT_LITERALS.get(text)
    if node is None:
        if not text:
            return _EMPTY
        node = Literal(text)
        if len(text) <= 4 and len(_SHORT_LITERALS) < 4096:
            _SHORT_LITERALS[text] = node
    return node


_SEQ_OR_EMPTY = (Seq, Empty)


def seq(*items: Expr) -> Expr:
    """Concatenation, flattening nested sequences and dropping Empty."""
    # Most calls have nothing to flatten or drop: the argument tuple is the node's items as is.
    for item in items:
        if isinstance(item, _SEQ_OR_EMPTY):
            break
    else:
        if len(items) > 1:
            return Seq(items)
        return items[0] if items else Empty()
    flat: list[Expr] = []
    for item in items:
        if isinstance(item, Seq):
            flat.extend(item.items)
        elif not isinstance(item, Empty):
            flat.append(item)
    if not flat:
        return Empty()
    return flat[0] if len(flat) == 1 else Seq(tuple(flat))


def _flat_alts(items: tuple[Expr, ...]) -> list[Expr]:
    flat: list[Expr] = []
    for item in items:
        if isinstance(item, Alt):
            flat.extend(item.items)
        else:
            flat.append(item)
    return flat


def alt(*items: Expr) -> Expr:
    """Alternation, flattening nested alternations and removing duplicates (first kept)."""
    flat = _flat_alts(items)
    if len(flat) > 8:
        # Long alternations (enum values, counted choices): drop duplicates through a set
        # instead of comparing every pair.
        try:
            seen: set[Expr] = set()
            unique = [x for x in flat if not (x in seen or seen.add(x))]  # type: ignore[func-returns-value]
            return unique[0] if len(unique) == 1 else Alt(tuple(unique))
        except TypeError:  # an unhashable foreign node: compare pairwise below
            pass
    unique = []
    for sub in flat:
        if sub not in unique:
            unique.append(sub)
    return unique[0] if len(unique) == 1 else Alt(tuple(unique))


def alt_disjoint(*items: Expr) -> Expr:
    """Alternation of items whose languages are pairwise disjoint (so no two are equal): nested
    alternations are flattened as by :func:`alt`, without its duplicate search, which hashes or
    compares whole subtrees (a JSON value's object and array alternatives are large)."""
    flat = _flat_alts(items)
    return flat[0] if len(flat) == 1 else Alt(tuple(flat))


def opt(item: Expr) -> Expr:
    """``item?``."""
    return Repeat(item, 0, 1)


def star(item: Expr) -> Expr:
    """``item*``."""
    return Repeat(item, 0, None)


def plus(item: Expr) -> Expr:
    """``item+``."""
    return Repeat(item, 1, None)


def chars(spec: str, *, negated: bool = False) -> CharClass:
    """A class from a compact spec such as ``"a-zA-Z_"`` (``-`` last or first is literal)."""
    ranges: list[tuple[int, int]] = []
    i = 0
    while i < len(spec):
        if i + 2 < len(spec) and spec[i + 1] == "-":
            ranges.append((ord(spec[i]), ord(spec[i + 2])))
            i += 3
        else:
            ranges.append((ord(spec[i]), ord(spec[i])))
            i += 1
    return CharClass(tuple(ranges), negated)


def walk(expr: Expr) -> Iterator[Expr]:
    """Pre-order traversal of ``expr``."""
    stack = [expr]
    while stack:
        node = stack.pop()
        yield node
        stack.extend(reversed(node.children()))


def clear_literal_memo() -> None:
    """Forget the shared short literals (``clear_grammar_caches`` calls this)."""
    _SHORT_LITERALS.clear()
