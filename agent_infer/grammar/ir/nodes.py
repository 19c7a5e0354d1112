"""The IR's node classes (:class:`Expr` and its twelve kinds) and the code point range helpers
:class:`CharClass` normalizes with. Re-exported by :mod:`agent_infer.grammar.ir`."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

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
    # A per-instance cache, set with object.__setattr__ (a class variable, so not a dataclass
    # field: equality, hashing and printing are unchanged).
    _normalized: ClassVar[tuple[tuple[int, int], ...] | None] = None

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


# -- run-time checks ------------------------------------------------------------------------------

MAX_CHECK_ITEMS = 16


@dataclass(frozen=True)
class Check(Expr):
    """A span the first ``carriers`` of ``items`` (each a :class:`Ref`) scan, kept only when, at
    its end, the set of items whose language holds it is one of ``accept``.

    Each entry of ``accept`` is a bitmask over ``items`` (bit i: ``items[i]`` accepts the span).
    The matcher follows every item over the span in parallel (the items past ``carriers`` only
    shadow it: they decide, they never let a byte through) and decides when a carrier finishes,
    so ``oneOf [A, B]`` is ``Check((A, B), 2, (0b01, 0b10))``, ``S and not N`` is
    ``Check((S, N), 1, (0b01,))`` and ``A and B`` is ``Check((A, B), 1, (0b11,))``. Only a
    rule's whole body; items must not match the empty string.

    Decided at run time (``product`` false), masks are exact only if every prefix the carriers
    can still extend has a completion the check accepts (the front end proves it). With
    ``product`` the compiler instead builds one automaton of the items' languages combined,
    without the prefixes no completion passes, and raises GrammarLimitError when the items
    recurse or the automaton would be too large (docs/grammar_engine.md, "Run-time checks")."""

    items: tuple[Ref, ...]
    carriers: int
    accept: tuple[int, ...]
    product: bool = False

    def __init__(
        self, items: tuple[Ref, ...], carriers: int, accept: tuple[int, ...], product: bool = False
    ) -> None:
        _set(self, "items", items)
        _set(self, "carriers", carriers)
        _set(self, "accept", accept)
        _set(self, "product", product)
        self.__post_init__()

    def __post_init__(self) -> None:
        n = len(self.items)
        if not 1 <= n <= MAX_CHECK_ITEMS:
            raise GrammarDefinitionError(f"a Check takes 1 to {MAX_CHECK_ITEMS} items, got {n}")
        if not all(type(item) is Ref for item in self.items):
            raise GrammarDefinitionError("a Check's items must be rule references (Ref)")
        if type(self.carriers) is not int or not 1 <= self.carriers <= n:
            raise GrammarDefinitionError(f"a Check's carriers must be in [1, {n}], got {self.carriers!r}")
        accept = self.accept
        if not all(type(a) is int and 0 <= a < (1 << n) for a in accept) or list(accept) != sorted(
            set(accept)
        ):
            raise GrammarDefinitionError(
                f"a Check's accept must be sorted, distinct bitmasks over its {n} items, got {accept!r}"
            )
        if type(self.product) is not bool:
            raise GrammarDefinitionError(f"a Check's product must be a bool, got {self.product!r}")

    def children(self) -> tuple[Expr, ...]:
        return self.items


# -- key tries ------------------------------------------------------------------------------------
#
# Two node kinds stand for the "any JSON object key but these names" tries of the JSON Schema front
# end, each compiled from a compact source rather than from branches: a whole trie as one
# ``KEY_TRIE`` instruction (:class:`KeySet`), and one trie node written from its spec
# (:class:`KeyNode`). Their meaning as an alternation (their *expansion*) is built from that source
# by the front end that makes them, which registers it with :func:`register_expansion`; it is read
# only by code that interprets the IR node by node (the reference recognizer, the test-string
# sampler, renaming for ``Grammar.union``), never by the compiler, and built on first use.

_EXPANSIONS: dict[type[Expr], Callable[[Any], tuple[Expr, ...]]] = {}


def register_expansion(kind: type[KeySet] | type[KeyNode], expand: Callable[[Any], tuple[Expr, ...]]) -> None:
    """Set how nodes of ``kind`` expand to the branches of an equivalent :class:`Alt`."""
    _EXPANSIONS[kind] = expand


class _Expanded(Expr):
    """A node with a compact source whose branches (:meth:`expand`) are built on first use."""

    __slots__ = ("_items",)
    _items: tuple[Expr, ...]

    def _args(self) -> tuple[Any, ...]:
        raise NotImplementedError

    def expand(self) -> tuple[Expr, ...]:
        """The branches of the :class:`Alt` this node is equivalent to (built once)."""
        try:
            return self._items
        except AttributeError:
            pass
        expand = _EXPANSIONS.get(type(self))
        if expand is None:
            raise GrammarDefinitionError(
                f"no expansion registered for {type(self).__name__} nodes (import agent_infer.grammar)"
            )
        items = expand(self)
        _set(self, "_items", items)
        return items

    def children(self) -> tuple[Expr, ...]:
        return self.expand()

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} nodes are immutable")

    def __eq__(self, other: object) -> bool:
        if type(other) is type(self):
            return self._args() == other._args()
        return NotImplemented

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._args()))

    def __reduce__(self) -> tuple[Any, ...]:
        # copy and pickle rebuild the node from its source (the slots are set past __setattr__).
        return (type(self), self._args())


class KeySet(_Expanded):
    """Any JSON object key (the text between its quotes) other than ``names``: sorted, distinct,
    each plain printable ASCII (no quote, slash or backslash). Compiled as one ``KEY_TRIE``
    instruction, whose automaton the native compiler builds from the names; only a whole rule body.

    Besides the names' trie it calls two rules the grammar must define: :data:`FREE_RULE` (a
    character that needs an escape or is not ASCII, then any rest of the key) and
    :data:`REST_RULE` (any rest of a key)."""

    __slots__ = ("_names",)
    _names: tuple[str, ...]
    FREE_RULE: ClassVar[str] = "char-key-free"
    REST_RULE: ClassVar[str] = "char-key-rest"

    def __init__(self, names: tuple[str, ...]) -> None:
        _set(self, "_names", names)

    @property
    def names(self) -> tuple[str, ...]:
        """The excluded names."""
        return self._names

    def _args(self) -> tuple[Any, ...]:
        return (self._names,)

    def __repr__(self) -> str:
        return f"KeySet(names={self._names!r})"


class KeyNode(_Expanded):
    """One node of a key trie: ``spec`` is (ends a name, code point, child rule name, code point,
    child rule name, ...), children in code point order. Compiled as the alternation of its edges
    (each child's code point, then the child's rule), its gap branch (any other character, then
    :data:`REST_RULE`) and, unless it ends a name, the end of the key; the native serializer
    writes that program from the spec."""

    __slots__ = ("_spec",)
    _spec: tuple[Any, ...]
    REST_RULE: ClassVar[str] = KeySet.REST_RULE

    def __init__(self, spec: tuple[Any, ...]) -> None:
        _set(self, "_spec", spec)

    @property
    def spec(self) -> tuple[Any, ...]:
        """(ends a name, code point, child rule, ...)."""
        return self._spec

    @property
    def ends_name(self) -> bool:
        """Whether the path to this node spells one of the names (so the key may not end here)."""
        return bool(self._spec[0])

    @property
    def edges(self) -> tuple[tuple[int, str], ...]:
        """(code point, child rule name) per child, in code point order."""
        spec = self._spec
        return tuple((spec[i], spec[i + 1]) for i in range(1, len(spec), 2))

    @property
    def items(self) -> tuple[Expr, ...]:
        """The branches of the alternation this node compiles to (:meth:`expand`): the native
        serializer writes them for a node with an edge that is not plain printable ASCII."""
        return self.expand()

    def _args(self) -> tuple[Any, ...]:
        return (self._spec,)

    def __repr__(self) -> str:
        return f"KeyNode(spec={self._spec!r})"


@dataclass(frozen=True)
class UniqueItem(Expr):
    """One item of a JSON array whose items must be distinct (``uniqueItems``): matches ``item``,
    and a match whose JSON value equals the value of an earlier item of the same array is
    rejected at the byte that completes it (the matcher compares values, not spellings).

    Only as a whole rule body, and only for items written inside a JSON array (``[`` or ``,``
    and blanks before the item): the earlier items are found by reading the text back from the
    item's start."""

    item: Expr

    def __init__(self, item: Expr) -> None:
        _set(self, "item", item)

    def children(self) -> tuple[Expr, ...]:
        return (self.item,)


@dataclass(frozen=True)
class BoundedString(Expr):
    """A JSON string (``item`` matches its text, quotes included) of at most ``max_length`` code
    points once decoded (each escape one, a surrogate pair one): the matcher counts them as the
    string is read, for bounds whose automaton product would be too large to build.

    Only as a whole rule body."""

    item: Expr
    max_length: int

    def __init__(self, item: Expr, max_length: int) -> None:
        _set(self, "item", item)
        _set(self, "max_length", max_length)
        if max_length < 0:
            raise GrammarDefinitionError(f"a bounded string's max_length must be >= 0, got {max_length}")

    def children(self) -> tuple[Expr, ...]:
        return (self.item,)


NODE_KINDS: tuple[type[Expr], ...] = (
    Empty,
    Literal,
    CharClass,
    Seq,
    Alt,
    Repeat,
    Ref,
    KeyNode,
    KeySet,
    UniqueItem,
    BoundedString,
    Check,
)
"""Every node kind, in the order the native serializer and reference walk take them."""
