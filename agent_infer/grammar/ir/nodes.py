"""The IR's node classes (:class:`Expr` and its seven kinds) and the code point range helpers
:class:`CharClass` normalizes with. Re-exported by :mod:`agent_infer.grammar.ir`."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar

from agent_infer.errors import GrammarDefinitionError

MAX_CODEPOINT = 0x10FFFF


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
