"""Sound, incomplete proofs that two flattened schemas share no instance (for ``oneOf``).

A proof lets ``oneOf`` lower to a plain alternation. Each rule below only answers "disjoint" when
no JSON value can satisfy both schemas; anything it cannot decide is "maybe overlapping", and the
caller then intersects branches with complements instead.

The rules, per pair: every branch of one side's ``anyOf``/``oneOf`` disjoint from the other side;
disjoint listed values (each side's ``enum``/``const`` less the values its own type, length, range
and pattern keywords reject); listed values outside the other's types; no common type (``not``
of whole types included); and, when the only common type is ``object`` or ``array``, a member
that one side requires and the other forbids, a member one side requires with disjoint schemas on
the two sides (declared, or what ``additionalProperties`` gives it), disjoint property or item
counts (``required`` names count towards ``minProperties``), or an item position both require with
disjoint schemas; for strings, disjoint lengths or patterns no string matches together; for
numbers, disjoint ranges.
"""

from __future__ import annotations

from collections.abc import Callable
from fractions import Fraction
from typing import Any

from agent_infer.errors import GrammarLimitError, InvalidSchemaError, UnsupportedSchemaError
from agent_infer.grammar.automata import DFA, dfa_intersect, dfa_is_empty
from agent_infer.grammar.frontends.json_schema.keywords import type_set, values
from agent_infer.grammar.frontends.json_schema.values.canon import canon, json_type, to_fraction

# Recursion through member schemas; deeper pairs are "maybe overlapping".
MAX_DEPTH = 6

Flatten = Callable[[Any], Any]
Matches = Callable[[str, str], bool]
# Whether no string matches every pattern of the first list and every one of the second.
PatternsApart = Callable[[list[str], list[str]], bool]


def patterns_oracle(pattern_dfa: Callable[[str], DFA]) -> PatternsApart:
    """``patterns_apart`` over the compiler's pattern automata: the product of all the patterns
    is empty. A pattern that cannot be compiled, or a product over the state limit, proves nothing."""

    def apart(pa: list[str], pb: list[str]) -> bool:
        try:
            dfa: DFA | None = None
            for p in dict.fromkeys([*pa, *pb]):
                d = pattern_dfa(p)
                dfa = d if dfa is None else dfa_intersect(dfa, d)
            return dfa is not None and dfa_is_empty(dfa)
        except (GrammarLimitError, InvalidSchemaError, UnsupportedSchemaError):
            return False

    return apart


def disjoint(
    a: Any,
    b: Any,
    flat: Flatten,
    matches: Matches | None = None,
    depth: int = 0,
    patterns_apart: PatternsApart | None = None,
) -> bool:
    """True if no instance can satisfy both flattened schemas ``a`` and ``b``.

    ``flat`` flattens a member schema; ``matches(pattern, name)`` tests a ``patternProperties``
    pattern against a key (without it, a side with patterns never forbids a key);
    ``patterns_apart`` decides two strings' ``pattern``s (without it, patterns prove nothing).
    """
    if a is False or b is False or _empty(a) or _empty(b):
        return True
    if a is True or b is True or depth > MAX_DEPTH:
        return False
    for x, y in ((a, b), (b, a)):
        # Siblings only narrow a schema's branches: each branch apart from the other side suffices.
        for key in ("anyOf", "oneOf"):
            branches = x.get(key)
            if (
                isinstance(branches, list)
                and branches
                and all(disjoint(flat(br), y, flat, matches, depth + 1, patterns_apart) for br in branches)
            ):
                return True
    ta, tb = _types(a), _types(b)
    va, vb = _listed(a, matches), _listed(b, matches)
    if va is not None and vb is not None and not ({canon(x) for x in va} & {canon(x) for x in vb}):
        return True
    for vals, types in ((va, tb), (vb, ta)):
        if vals is not None and types is not None and all(json_type(v) not in types for v in vals):
            return True
    if ta is None or tb is None:
        return False
    common = ta & tb
    if not common:
        return True
    if common == {"object"}:
        return _objects_disjoint(a, b, flat, matches, depth, patterns_apart) or _ranges_disjoint(
            _counted(a), _counted(b), "minProperties", "maxProperties"
        )
    if common == {"array"}:
        return _arrays_disjoint(a, b, flat, matches, depth, patterns_apart) or _ranges_disjoint(
            a, b, "minItems", "maxItems"
        )
    if common == {"string"}:
        if _ranges_disjoint(a, b, "minLength", "maxLength"):
            return True
        pa, pb = _patterns(a), _patterns(b)
        return bool(pa and pb and patterns_apart is not None and patterns_apart(pa, pb))
    if common <= {"number", "integer"}:
        return _numbers_disjoint(a, b)
    return False


def _empty(s: Any) -> bool:
    return isinstance(s, dict) and s.get("type") == []


_ALL_TYPES = {"null", "boolean", "object", "array", "string", "number", "integer"}


def _types(s: dict[str, Any]) -> set[str] | None:
    """type_set less the types a folded ``not`` bans (``__not_types``); None when unconstrained."""
    t = type_set(s)
    banned = s.get("__not_types")
    if not isinstance(banned, list) or not banned:
        return t
    out = set(_ALL_TYPES if t is None else t)
    for name in banned:
        out.discard(name)
        if name == "number":
            out.discard("integer")
    return out


def _listed(s: dict[str, Any], matches: Matches | None) -> list[Any] | None:
    """The listed values (enum/const) that the schema's own type, length, range and pattern
    keywords leave; None when it lists none. Dropping a value only where a keyword surely
    rejects it keeps the list a superset of the schema's instances."""
    vals = values(s)
    if vals is None:
        return None
    types = _types(s)
    lo, lo_open, hi, hi_open = _interval(s)
    pats = _patterns(s)
    min_len, max_len = _count(s, "minLength"), s.get("maxLength")

    def keep(v: Any) -> bool:
        kind = json_type(v)
        if types is not None and kind not in types and not (kind == "integer" and "number" in types):
            return False
        if isinstance(v, str):
            if len(v) < min_len or (isinstance(max_len, int) and len(v) > max_len):
                return False
            return matches is None or all(matches(p, v) for p in pats)
        if isinstance(v, int | float) and not isinstance(v, bool):
            x = to_fraction(v)
            if lo is not None and (x < lo or (lo_open and x == lo)):
                return False
            if hi is not None and (x > hi or (hi_open and x == hi)):
                return False
        return True

    return [v for v in vals if keep(v)]


def _counted(s: dict[str, Any]) -> dict[str, Any]:
    """``s`` with ``minProperties`` raised to its number of distinct required names."""
    required = s.get("required")
    need = len(set(required)) if isinstance(required, list) else 0
    if need <= _count(s, "minProperties"):
        return s
    return {**s, "minProperties": need}


def _member(s: dict[str, Any], name: str, flat: Flatten, matches: Matches | None) -> Any | None:
    """The schema an object valid under ``s`` gives its member ``name``, when one schema says it
    all (declared, or additional with no pattern matching); None when patterns decide it."""
    props = s.get("properties", {})
    if name in props:
        return flat(props[name])
    patterns = s.get("patternProperties") or {}
    if patterns and (matches is None or any(matches(p, name) for p in patterns)):
        return None
    return flat(s.get("additionalProperties", True))


def _forbids(s: dict[str, Any], name: str, flat: Flatten, matches: Matches | None) -> bool:
    """Whether an object valid under ``s`` can never have the member ``name``."""
    props = s.get("properties", {})
    if name in props:
        sub = flat(props[name])
        return sub is False or _empty(sub)
    patterns = s.get("patternProperties") or {}
    if patterns:
        if matches is None:
            return False
        hits = [p for p in patterns if matches(p, name)]
        if hits:
            return any(flat(patterns[p]) is False for p in hits)
    extra = s.get("additionalProperties", True)
    return extra is False or _empty(flat(extra))


def _patterns(s: dict[str, Any]) -> list[str]:
    p = s.get("pattern")
    if isinstance(p, str):
        return [p]
    if isinstance(p, dict) and isinstance(p.get("__patterns"), list):
        return [x for x in p["__patterns"] if isinstance(x, str)]
    return []


def _objects_disjoint(
    a: dict[str, Any],
    b: dict[str, Any],
    flat: Flatten,
    matches: Matches | None,
    depth: int,
    patterns_apart: PatternsApart | None,
) -> bool:
    ra, rb = set(a.get("required", ())), set(b.get("required", ()))
    if any(_forbids(b, n, flat, matches) for n in ra) or any(_forbids(a, n, flat, matches) for n in rb):
        return True
    # A member one side requires is in every common instance, with both sides' schemas for it.
    for name in sorted(ra | rb):
        ma, mb = _member(a, name, flat, matches), _member(b, name, flat, matches)
        if ma is not None and mb is not None and disjoint(ma, mb, flat, matches, depth + 1, patterns_apart):
            return True
    return False


def _arrays_disjoint(
    a: dict[str, Any],
    b: dict[str, Any],
    flat: Flatten,
    matches: Matches | None,
    depth: int,
    patterns_apart: PatternsApart | None,
) -> bool:
    if isinstance(a.get("items"), list) or isinstance(b.get("items"), list):
        return False
    need = max(_count(a, "minItems"), _count(b, "minItems"))
    pa, pb = a.get("prefixItems", []), b.get("prefixItems", [])
    for i in range(min(need, 64)):
        xa = flat(pa[i]) if i < len(pa) else flat(a.get("items", True))
        xb = flat(pb[i]) if i < len(pb) else flat(b.get("items", True))
        if disjoint(xa, xb, flat, matches, depth + 1, patterns_apart):
            return True
    return False


def _count(s: dict[str, Any], key: str) -> int:
    v = s.get(key, 0)
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0


def _ranges_disjoint(a: dict[str, Any], b: dict[str, Any], lo_key: str, hi_key: str) -> bool:
    def bound(s: dict[str, Any], key: str) -> int | None:
        v = s.get(key)
        return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None

    for x, y in ((a, b), (b, a)):
        lo, hi = bound(x, lo_key), bound(y, hi_key)
        if lo is not None and hi is not None and lo > hi:
            return True
    return False


def _interval(s: dict[str, Any]) -> tuple[Fraction | None, bool, Fraction | None, bool]:
    """(low, low_open, high, high_open) of a number schema; None for an open side."""

    def num(key: str) -> Fraction | None:
        v = s.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return to_fraction(v)
        return None

    lo, lo_open = num("minimum"), False
    xlo = num("exclusiveMinimum")
    if xlo is not None and (lo is None or xlo >= lo):
        lo, lo_open = xlo, True
    hi, hi_open = num("maximum"), False
    xhi = num("exclusiveMaximum")
    if xhi is not None and (hi is None or xhi <= hi):
        hi, hi_open = xhi, True
    return lo, lo_open, hi, hi_open


def _numbers_disjoint(a: dict[str, Any], b: dict[str, Any]) -> bool:
    alo, alo_open, ahi, ahi_open = _interval(a)
    blo, blo_open, bhi, bhi_open = _interval(b)
    for lo, lo_open, hi, hi_open in ((alo, alo_open, bhi, bhi_open), (blo, blo_open, ahi, ahi_open)):
        if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_open or hi_open))):
            return True
    return False
