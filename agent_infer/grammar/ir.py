"""The one grammar IR every front end lowers to (regex, JSON Schema, GBNF, Lark, choices).

A :class:`Grammar` is an ordered set of named rules, each an :class:`Expr` tree over Unicode
code points. The tree has seven node kinds and nothing else:

* :class:`Empty` -- the empty string.
* :class:`Literal` -- a fixed, non-empty string.
* :class:`CharClass` -- one code point from inclusive ranges (optionally negated).
* :class:`Seq` / :class:`Alt` -- concatenation / alternation.
* :class:`Repeat` -- ``item{min,max}`` (``max=None`` is unbounded).
* :class:`Ref` -- a reference to another rule (recursion, including left recursion, is allowed).

``str(grammar)`` prints GBNF (llama.cpp's dialect, plus ``_`` in names), which our GBNF front end
reads back to an equal grammar, so a failing test can show what a schema lowered to.
The native compiler lowers the tree to UTF-8 byte automata; see ``docs/grammar_engine.md``.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from agent_infer.errors import GrammarDefinitionError
from agent_infer.grammar.caches import register_cache
from agent_infer.grammar.gc_pause import pauses_gc

if TYPE_CHECKING:
    from pydantic import BaseModel

MAX_CODEPOINT = 0x10FFFF
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
# Names joined by NUL all match _NAME_RE when this matches (NUL is in no valid name).
_NAMES_RE = re.compile(r"[A-Za-z0-9_-]+(?:\x00[A-Za-z0-9_-]+)*\Z")


class Expr:
    """Base class of IR nodes. Nodes are frozen dataclasses: hashable and comparable."""

    __slots__ = ()
    # Set on a composite node (object.__setattr__; not a dataclass field) once its subtree is
    # known to hold no Ref: grammar validation then skips it, in this grammar and every other
    # one sharing the node (the fixed JSON rules, cached string encodings).
    _ref_free: ClassVar[bool] = False

    def children(self) -> tuple[Expr, ...]:
        """Direct sub-expressions."""
        return ()


# The node classes below have a hand-written ``__init__`` (which dataclass keeps) that stores
# fields through a module-level ``object.__setattr__``: the generated frozen ``__init__`` looks
# that up per field (about 25 % slower), and front ends build tens of thousands of nodes per large
# schema. (Writing ``self.__dict__`` directly would be faster still, but materializes a dict per
# node: +60 % memory and one more object for the cyclic collector to scan.) Equality, hashing,
# printing and ``dataclasses.replace`` are unchanged.
_set = object.__setattr__


@dataclass(frozen=True)
class Empty(Expr):
    """Matches the empty string."""


@dataclass(frozen=True)
class Literal(Expr):
    """Matches ``text`` exactly. ``text`` must be non-empty (use :class:`Empty` otherwise)."""

    text: str

    def __init__(self, text: str) -> None:
        if not text:  # __post_init__'s check, inline: front ends build many literals
            raise GrammarDefinitionError("Literal text must be non-empty; use Empty()")
        _set(self, "text", text)

    def __post_init__(self) -> None:
        if not self.text:
            raise GrammarDefinitionError("Literal text must be non-empty; use Empty()")


@dataclass(frozen=True)
class CharClass(Expr):
    """Matches one code point in ``ranges`` (inclusive pairs), or not in them when ``negated``."""

    ranges: tuple[tuple[int, int], ...]
    negated: bool = False
    # Per-instance caches, set with object.__setattr__ (class variables, so not dataclass fields:
    # equality, hashing and printing are unchanged).
    _normalized: ClassVar[tuple[tuple[int, int], ...] | None] = None
    _program: ClassVar[tuple[int, ...] | None] = None

    def __init__(self, ranges: tuple[tuple[int, int], ...], negated: bool = False) -> None:
        _set(self, "ranges", ranges)
        _set(self, "negated", negated)
        self.__post_init__()

    def __post_init__(self) -> None:
        for lo, hi in self.ranges:
            if not (0 <= lo <= hi <= MAX_CODEPOINT):
                raise GrammarDefinitionError(f"invalid character range {lo:#x}-{hi:#x}")

    def normalized(self) -> tuple[tuple[int, int], ...]:
        """The sorted, merged, non-negated ranges this class matches (may be empty)."""
        # Cached on the instance: front ends and the serializer ask for it many times per node.
        cached = self._normalized
        if cached is None:
            cached = _normalize(self.ranges, self.negated)
            object.__setattr__(self, "_normalized", cached)
        return cached


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sort and merge overlapping or adjacent inclusive code point ranges."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            if hi > merged[-1][1]:
                merged[-1][1] = hi
        else:
            merged.append([lo, hi])
    return tuple((a, b) for a, b in merged)


def complement_ranges(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """All code points (up to U+10FFFF) not in ``ranges``."""
    out: list[tuple[int, int]] = []
    nxt = 0
    for lo, hi in merge_ranges(ranges):
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CODEPOINT:
        out.append((nxt, MAX_CODEPOINT))
    return tuple(out)


def _normalize(ranges: tuple[tuple[int, int], ...], negated: bool) -> tuple[tuple[int, int], ...]:
    return complement_ranges(ranges) if negated else merge_ranges(ranges)


@dataclass(frozen=True)
class Seq(Expr):
    """Concatenation of ``items`` in order."""

    items: tuple[Expr, ...]

    def __init__(self, items: tuple[Expr, ...]) -> None:
        _set(self, "items", items)

    def children(self) -> tuple[Expr, ...]:
        return self.items


@dataclass(frozen=True)
class Alt(Expr):
    """Alternation: any one of ``items``. An empty ``items`` matches nothing."""

    items: tuple[Expr, ...]

    def __init__(self, items: tuple[Expr, ...]) -> None:
        _set(self, "items", items)

    def children(self) -> tuple[Expr, ...]:
        return self.items


@dataclass(frozen=True)
class Repeat(Expr):
    """``item`` repeated between ``min`` and ``max`` times (``max=None``: unbounded)."""

    item: Expr
    min: int = 0
    max: int | None = None

    def __init__(self, item: Expr, min: int = 0, max: int | None = None) -> None:
        _set(self, "item", item)
        _set(self, "min", min)
        _set(self, "max", max)
        if min < 0 or (max is not None and max < min):
            self.__post_init__()  # raises

    def __post_init__(self) -> None:
        if self.min < 0 or (self.max is not None and self.max < self.min):
            raise GrammarDefinitionError(f"invalid repetition bounds {{{self.min},{self.max}}}")

    def children(self) -> tuple[Expr, ...]:
        return (self.item,)


@dataclass(frozen=True)
class Ref(Expr):
    """A reference to the rule called ``name``."""

    name: str

    def __init__(self, name: str) -> None:
        _set(self, "name", name)


# --- small constructors, so front ends read like grammars -----------------------------------------

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


# --- printing as GBNF --------------------------------------------------------------------------------


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


def _fmt(expr: Expr, prec: int) -> str:
    """Format with precedence: 0 = alternation, 1 = sequence, 2 = atom."""
    if isinstance(expr, Empty):
        return '""'
    if isinstance(expr, Literal):
        return '"' + "".join(_escape_char(ord(c), False) for c in expr.text) + '"'
    if isinstance(expr, CharClass):
        body = "".join(
            _escape_char(lo, True) if lo == hi else f"{_escape_char(lo, True)}-{_escape_char(hi, True)}"
            for lo, hi in expr.ranges
        )
        return f"[{'^' if expr.negated else ''}{body}]"
    if isinstance(expr, Ref):
        return expr.name
    if isinstance(expr, Seq):
        text = " ".join(_fmt(item, 2 if isinstance(item, Alt | Seq) else 1) for item in expr.items)
        return f"({text})" if prec >= 2 else text
    if isinstance(expr, Alt):
        if not expr.items:
            return "[^\\x00-\\U0010FFFF]"  # a class that matches nothing: the empty language
        text = " | ".join(_fmt(item, 1) for item in expr.items)
        return f"({text})" if prec >= 1 else text
    if isinstance(expr, Repeat):
        inner = _fmt(expr.item, 2)
        if isinstance(expr.item, Repeat):
            inner = f"({inner})"
        lo, hi = expr.min, expr.max
        if (lo, hi) == (0, None):
            return inner + "*"
        if (lo, hi) == (1, None):
            return inner + "+"
        if (lo, hi) == (0, 1):
            return inner + "?"
        if hi is None:
            return f"{inner}{{{lo},}}"
        if lo == hi:
            return f"{inner}{{{lo}}}"
        return f"{inner}{{{lo},{hi}}}"
    raise TypeError(f"not an IR node: {expr!r}")


# --- the grammar ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grammar:
    """An immutable grammar: ordered ``rules`` (name, expr) and the ``root`` rule's name.

    ``warnings`` lists constraints a non-strict front end could not enforce (e.g. ignored JSON
    Schema keywords with their pointers); they surface as ``CompiledGrammar.warnings``.
    """

    rules: tuple[tuple[str, Expr], ...]
    root: str = "root"
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        # The root always comes first, so equality does not depend on how rules were listed
        # and ``parse_gbnf(str(g)) == g`` holds (str prints the root first).
        ordered = tuple(sorted(self.rules, key=lambda r: r[0] != self.root))
        if ordered != self.rules:
            object.__setattr__(self, "rules", ordered)
        names = [name for name, _ in self.rules]
        seen: set[str] = set(names)
        # One regex pass over all names; only when it fails (or a name repeats) does the per-name
        # loop run, which reports the first offending name in rule order.
        if len(seen) != len(names) or not _NAMES_RE.match("\x00".join(names)):
            seen = set()
            for name in names:
                if not _NAME_RE.match(name):
                    raise GrammarDefinitionError(
                        f"invalid rule name {name!r} (use letters, digits, '_' and '-')"
                    )
                if name in seen:
                    raise GrammarDefinitionError(f"rule {name!r} is defined twice")
                seen.add(name)
        if self.root not in seen:
            raise GrammarDefinitionError(f"root rule {self.root!r} is not defined")
        from agent_infer.grammar.ir_references import first_undefined_ref

        found = first_undefined_ref(self.rules, seen)
        if found is not None:
            raise GrammarDefinitionError(f"rule {found[0]!r} refers to undefined rule {found[1]!r}")

    @classmethod
    def unchecked(
        cls, rules: tuple[tuple[str, Expr], ...], root: str = "root", warnings: tuple[str, ...] = ()
    ) -> Grammar:
        """A grammar from a front end whose rules are well formed by construction (valid distinct
        names, the root first, every reference defined), without the validation walk over every
        node: a large JSON Schema grammar holds ~10^5 nodes that the serializer walks anyway, and it
        reports an undefined reference as GrammarDefinitionError when the grammar is compiled.
        Anything else goes through the validating constructor."""
        if not rules or rules[0][0] != root:
            return cls(rules, root, warnings)
        grammar = object.__new__(cls)
        _set(grammar, "rules", rules)
        _set(grammar, "root", root)
        _set(grammar, "warnings", warnings)
        return grammar

    # -- access --

    @property
    def rule_map(self) -> dict[str, Expr]:
        """Rules as a dict (insertion-ordered)."""
        return dict(self.rules)

    def rule(self, name: str) -> Expr:
        """The expression of rule ``name``."""
        for rule_name, expr in self.rules:
            if rule_name == name:
                return expr
        raise KeyError(name)

    def prefixed(self, prefix: str) -> tuple[tuple[tuple[str, Expr], ...], str]:
        """The rules renamed ``prefix + name`` (references too) and the renamed root: the pieces to
        embed this grammar inside another one without name clashes."""
        mapping = {name: f"{prefix}{name}" for name, _ in self.rules}
        return tuple((mapping[name], _rename(expr, mapping)) for name, expr in self.rules), mapping[self.root]

    def fingerprint(self) -> str:
        """A stable hash of the printed grammar (computed once per instance: grammars are immutable)."""
        cached: str | None = getattr(self, "_fingerprint", None)
        if cached is None:
            cached = hashlib.sha256(f"{self.root}\n{self}".encode()).hexdigest()
            object.__setattr__(self, "_fingerprint", cached)
        return cached

    def __str__(self) -> str:
        return "\n".join(f"{name} ::= {_fmt(expr, 0)}" for name, expr in self.rules) + "\n"

    # -- construction --

    @classmethod
    def from_rules(
        cls, rules: Mapping[str, Expr] | Iterable[tuple[str, Expr]], root: str = "root"
    ) -> Grammar:
        """Build from a mapping or pairs of rule name -> expression."""
        items = tuple(rules.items()) if isinstance(rules, Mapping) else tuple(rules)
        return cls(items, root)

    @classmethod
    def from_expr(cls, expr: Expr) -> Grammar:
        """A grammar whose only rule, ``root``, is ``expr``."""
        return cls((("root", expr),), "root")

    @classmethod
    @pauses_gc
    def from_regex(cls, pattern: str) -> Grammar:
        """Python ``re`` syntax, matched in full. Lookarounds and backreferences raise UnsupportedRegexError."""
        from agent_infer.grammar.regex import regex_to_grammar

        return regex_to_grammar(pattern)

    @classmethod
    @pauses_gc
    def from_json_schema(
        cls,
        schema: dict[str, Any] | str | type[BaseModel] | bool,
        *,
        strict: bool = True,
        whitespace: str = "flexible",
        max_whitespace: int = 2,
        indent: int | None = None,
        remotes: Mapping[str, Any] | None = None,
    ) -> Grammar:
        """JSON Schema (dict, JSON text, or a Pydantic model class) to a grammar of conforming JSON.

        ``whitespace``: ``"compact"`` (no optional whitespace) or ``"flexible"`` (at most
        ``max_whitespace`` whitespace characters at each optional spot). ``indent`` pins a layout.
        In strict mode an unenforceable keyword raises UnsupportedSchemaError. ``remotes`` maps
        absolute URIs to documents that ``$ref`` may point into (nothing is fetched).
        """
        from agent_infer.grammar.json_schema import json_schema_to_grammar

        return json_schema_to_grammar(
            schema,
            strict=strict,
            whitespace=whitespace,
            max_whitespace=max_whitespace,
            indent=indent,
            remotes=remotes,
        )

    @classmethod
    @pauses_gc
    def from_ebnf(cls, text: str, *, syntax: str = "gbnf", start: str | None = None) -> Grammar:
        """An EBNF grammar in llama.cpp's GBNF (``syntax="gbnf"``, start ``root``) or Lark (start ``start``)."""
        if syntax == "gbnf":
            from agent_infer.grammar.gbnf import parse_gbnf

            return parse_gbnf(text, start=start or "root")
        if syntax == "lark":
            from agent_infer.grammar.lark_frontend import parse_lark

            return parse_lark(text, start=start or "start")
        raise GrammarDefinitionError(f"unknown EBNF syntax {syntax!r}; expected 'gbnf' or 'lark'")

    @classmethod
    def builtin(cls, name: str) -> Grammar:
        """Load ``grammars/NAME.gbnf`` or ``grammars/NAME.lark`` shipped with agent-infer."""
        path = builtin_grammar_path(name)
        syntax = "lark" if path.suffix == ".lark" else "gbnf"
        return cls.from_ebnf(path.read_text(encoding="utf-8"), syntax=syntax)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Grammar:
        """Exactly one of the given strings."""
        if not options:
            raise GrammarDefinitionError("choice needs at least one option")
        return cls.from_expr(alt(*(lit(o) for o in options)))

    @classmethod
    def union(cls, *grammars: Grammar) -> Grammar:
        """Strings of any one of ``grammars``."""
        return _combine(grammars, alt)

    @classmethod
    def concat(cls, *grammars: Grammar) -> Grammar:
        """A string of each of ``grammars`` in order."""
        return _combine(grammars, seq)


def _rename(expr: Expr, mapping: Mapping[str, str]) -> Expr:
    if isinstance(expr, Ref):
        return Ref(mapping[expr.name])
    if isinstance(expr, Seq):
        return Seq(tuple(_rename(e, mapping) for e in expr.items))
    if isinstance(expr, Alt):
        return Alt(tuple(_rename(e, mapping) for e in expr.items))
    if isinstance(expr, Repeat):
        return Repeat(_rename(expr.item, mapping), expr.min, expr.max)
    return expr


def _combine(grammars: Sequence[Grammar], join: Any) -> Grammar:
    if not grammars:
        raise GrammarDefinitionError("union/concat needs at least one grammar")
    rules: list[tuple[str, Expr]] = []
    roots: list[Expr] = []
    warnings: list[str] = []
    for i, g in enumerate(grammars):
        renamed, root = g.prefixed(f"g{i}-")
        rules.extend(renamed)
        roots.append(Ref(root))
        warnings.extend(g.warnings)
    return Grammar((("root", join(*roots)), *rules), "root", tuple(warnings))


def grammars_dir() -> Path:
    """Where built-in grammar files live: the checkout's ``grammars/`` or the installed package data."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here.parent / "grammars", here / "grammars_data"):
        if candidate.is_dir():
            return candidate
    raise GrammarDefinitionError(f"built-in grammars folder not found next to {here}")


def builtin_grammar_path(name: str) -> Path:
    """The file of built-in grammar ``name``; the error lists the available names."""
    folder = grammars_dir()
    for suffix in (".gbnf", ".lark"):
        path = folder / f"{name}{suffix}"
        if _NAME_RE.match(name) and path.is_file():
            return path
    available = sorted(p.stem for p in folder.iterdir() if p.suffix in (".gbnf", ".lark"))
    raise GrammarDefinitionError(f"no built-in grammar {name!r}; available: {', '.join(available)}")


register_cache(_SHORT_LITERALS)
