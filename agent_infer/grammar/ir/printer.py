"""Printing IR expressions as GBNF (llama.cpp's dialect, plus ``_`` in names): what
``str(grammar)`` shows and the GBNF front end reads back.

The two key-trie kinds print as what the compiler takes, not as their expansions:
``%key-set("a" "b")`` for a :class:`KeySet` (one ``KEY_TRIE`` instruction over those names) and
``%key-node(ends-name "a"->char-key-n1 ...)`` for a :class:`KeyNode` (its edges, and whether it ends
a name). A :class:`UniqueItem` rule body prints as ``%unique(...)`` around its item, a
:class:`BoundedString` as ``%max-length(N ...)``, and a run-time check as
``%check(carriers=2 accept=1,2 a b)`` (its carriers, its accepted membership sets as decimal
bitmasks, ``product`` when it is compiled to one automaton, its rule references). llama.cpp does
not read these forms; our GBNF front end does, so every grammar prints as text it reads back to
an equal grammar.
"""

from __future__ import annotations

from agent_infer.grammar.ir.nodes import (
    Alt,
    BoundedString,
    CharClass,
    Check,
    Empty,
    Expr,
    KeyNode,
    KeySet,
    Literal,
    Ref,
    Repeat,
    Seq,
    UniqueItem,
)


def _escape_char(cp: int, in_class: bool) -> str:
    special = {0x5C: "\\\\", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
    if cp in special:
        return special[cp]
    if in_class and chr(cp) in "][":
        return "\\" + chr(cp)
    if in_class and chr(cp) in "-^":
        return f"\\x{cp:02X}"  # llama.cpp rejects \- and \^ inside classes
    if not in_class and cp == 0x22:
        return '\\"'
    if cp < 0x20 or cp == 0x7F:
        return f"\\x{cp:02X}"
    if 0xD800 <= cp <= 0xDFFF or cp in (0x2028, 0x2029) or (0x80 <= cp <= 0x9F):
        return f"\\u{cp:04X}" if cp <= 0xFFFF else f"\\U{cp:08X}"
    if cp > 0xFFFF and not chr(cp).isprintable():
        return f"\\U{cp:08X}"
    return chr(cp)


def _quoted(text: str) -> str:
    return '"' + "".join(_escape_char(ord(c), False) for c in text) + '"'


def _key_set(node: KeySet) -> str:
    return "%key-set(" + " ".join(_quoted(name) for name in node.names) + ")"


def _key_node(node: KeyNode) -> str:
    edges = [f"{_quoted(chr(cp))}->{rule}" for cp, rule in node.edges]
    return "%key-node(" + " ".join(["ends-name", *edges] if node.ends_name else edges) + ")"


def _check(node: Check) -> str:
    accept = ",".join(str(a) for a in node.accept)
    head = f"%check(carriers={node.carriers} accept={accept} " + ("product " if node.product else "")
    return head + " ".join(r.name for r in node.items) + ")"


def _leaf(expr: Expr) -> str | None:
    """The text of a node printed without its children's (None for Seq, Repeat and non-empty Alt)."""
    if isinstance(expr, Check):
        return _check(expr)
    if isinstance(expr, KeySet):
        return _key_set(expr)
    if isinstance(expr, KeyNode):
        return _key_node(expr)
    if isinstance(expr, Empty):
        return '""'
    if isinstance(expr, Literal):
        return _quoted(expr.text)
    if isinstance(expr, CharClass):
        body = "".join(
            _escape_char(lo, True) if lo == hi else f"{_escape_char(lo, True)}-{_escape_char(hi, True)}"
            for lo, hi in expr.ranges
        )
        return f"[{'^' if expr.negated else ''}{body}]"
    if isinstance(expr, Ref):
        return expr.name
    if isinstance(expr, Alt) and not expr.items:
        return "[^\\x00-\\U0010FFFF]"  # a class that matches nothing: the empty language
    if isinstance(expr, Seq | Alt | Repeat | UniqueItem | BoundedString):
        return None
    raise TypeError(f"not an IR node: {expr!r}")


def _repeat_suffix(lo: int, hi: int | None) -> str:
    if (lo, hi) == (0, None):
        return "*"
    if (lo, hi) == (1, None):
        return "+"
    if (lo, hi) == (0, 1):
        return "?"
    if hi is None:
        return f"{{{lo},}}"
    if lo == hi:
        return f"{{{lo}}}"
    return f"{{{lo},{hi}}}"


def _fmt(expr: Expr, prec: int) -> str:
    """Format with precedence: 0 = alternation, 1 = sequence, 2 = atom.

    Iterative (an explicit stack, children's texts on ``done``): a programmatically built
    expression may nest thousands of levels, more than Python's recursion limit allows."""
    done: list[str] = []
    todo: list[tuple[Expr, int, bool]] = [(expr, prec, False)]
    while todo:
        node, p, children_done = todo.pop()
        if not children_done:
            text = _leaf(node)
            if text is not None:
                done.append(text)
                continue
            todo.append((node, p, True))
            if isinstance(node, UniqueItem | BoundedString):
                todo.append((node.item, 0, False))
            elif isinstance(node, Repeat):
                todo.append((node.item, 2, False))
            else:
                assert isinstance(node, Seq | Alt)
                for item in reversed(node.items):
                    todo.append(
                        (
                            item,
                            (2 if isinstance(item, Alt | Seq) else 1) if isinstance(node, Seq) else 1,
                            False,
                        )
                    )
            continue
        if isinstance(node, UniqueItem):
            done.append(f"%unique({done.pop()})")
            continue
        if isinstance(node, BoundedString):
            done.append(f"%max-length({node.max_length} {done.pop()})")
            continue
        if isinstance(node, Repeat):
            inner = done.pop()
            if isinstance(node.item, Repeat):
                inner = f"({inner})"
            done.append(inner + _repeat_suffix(node.min, node.max))
            continue
        assert isinstance(node, Seq | Alt)
        n = len(node.items)
        parts = done[len(done) - n :]
        del done[len(done) - n :]
        if isinstance(node, Seq):
            text = " ".join(parts)
            done.append(f"({text})" if p >= 2 else text)
        else:
            text = " | ".join(parts)
            done.append(f"({text})" if p >= 1 else text)
    return done[0]
