"""``uniqueItems`` beyond ``maxItems: 1``: which item schemas can be enforced exactly, and how.

Two ways, both exact:

* **Listed values** (every item is one of at most :data:`MAX_LISTED_VALUES` values: an ``enum``,
  ``boolean``, ``null``, ...): the array is a grammar over the set of values used so far, one rule
  per subset (:func:`listed_unique_array`).
* **At run time**: each item is an :class:`~agent_infer.grammar.ir.UniqueItem` rule, and the
  matcher rejects an item at the byte that completes it when its value equals an earlier item's
  (``engine_native/src/grammar/match/unique.cpp``). The token masks stay exact when no item can
  get stuck: where an item is begun and its remaining values are not forced, it must have at least
  as many possible values left as the array has items (so an unused one always remains), and
  where its rest is forced, the forcing must happen outside strings, where the mask rechecks the
  token that reaches it. :func:`item_kind` decides this from the schema.

Item schemas that fit neither raise ``UnsupportedSchemaError(keyword="uniqueItems")`` with the
reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agent_infer.grammar.automata import DFA
from agent_infer.grammar.automata.queries import live_states
from agent_infer.grammar.frontends.json_schema.applicators.exclusivity import pairwise_disjoint
from agent_infer.grammar.frontends.json_schema.keywords import is_annotation, type_set, values
from agent_infer.grammar.frontends.json_schema.types.formats import is_unknown_format
from agent_infer.grammar.frontends.json_schema.types.members import required_first
from agent_infer.grammar.frontends.json_schema.types.numbers import number_bounds
from agent_infer.grammar.frontends.json_schema.values.canon import canon
from agent_infer.grammar.frontends.json_schema.values.enums import value_expr
from agent_infer.grammar.frontends.json_schema.values.validation import value_predicate
from agent_infer.grammar.ir import Alt, Empty, Expr, Ref, UniqueItem, seq

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler

MAX_LISTED_VALUES = 8
"""Item sets up to this size are enforced by the grammar itself (2^n rules)."""

FLOAT64_NUMBER_CHOICES = 11
"""Under the ``float64`` number policy a number can be a digit short of its limit (20 integer
digits, 3 exponent digits), with 11 ways left to end it: the most items such numbers allow."""


@dataclass
class ItemKind:
    """What an item schema allows, for uniqueness.

    ``open``: every begun value whose rest is not forced has unboundedly many completions left
    (at least ``limit`` where that is set). Otherwise the schema has "few" values: ``values``
    lists them when it can (``None``: finitely many, few left once begun, or not known), of the
    JSON ``types`` ("?": unknown). ``covers``: the types of which an open schema allows every
    value with every begun value unbounded (a listed value of such a type shares its begun
    values). ``reason``: why a schema has few values, for the error message.
    """

    open: bool = False
    limit: int | None = None
    values: list[Any] | None = None
    types: set[str] = field(default_factory=set)
    covers: set[str] = field(default_factory=set)
    reason: str | None = None


def _few(reason: str, *types: str) -> ItemKind:
    """Unlisted values of ``types`` ("?" when unknown) with few completions left once begun."""
    return ItemKind(types=set(types) or {"?"}, reason=reason)


def _listed(vals: list[Any]) -> ItemKind:
    seen: set[Any] = set()
    out = []
    for v in vals:
        key = canon(v)
        if key not in seen:
            seen.add(key)
            out.append(v)
    return ItemKind(values=out, types={_json_type(v) for v in out})


def _json_type(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return "literal"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "integer" if v.is_integer() else "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _union(kinds: list[ItemKind]) -> ItemKind:
    """The kind of the union of the alternatives' values."""
    few = [k for k in kinds if not k.open]
    open_ = [k for k in kinds if k.open]
    if not open_:
        unlisted = [k for k in few if k.values is None]
        if unlisted:
            return ItemKind(types=set().union(*(k.types for k in few)), reason=unlisted[0].reason)
        return _listed([v for k in few for v in k.values or []])
    covers = set().union(*(k.covers for k in open_))
    limits = [k.limit for k in open_ if k.limit is not None]
    for k in few:
        for t in k.types:
            if t == "literal":
                continue  # null/true/false: the first letter decides, the rest is forced outside strings
            if t not in covers and not (t == "integer" and "number" in covers):
                shown = k.reason or f"the listed values {json.dumps(k.values)[:40]}"
                return ItemKind(
                    types=set().union(*(x.types for x in kinds)),
                    reason=f"{shown}, beside item types that do not take each of their begun values",
                )
    return ItemKind(open=True, limit=min(limits) if limits else None, covers=covers)


def item_kind(
    c: Compiler, schema: Any, pointer: str, depth: int = 0, busy: set[int] | None = None
) -> ItemKind:
    """The :class:`ItemKind` of ``schema`` (flattened; containers read member by member). A schema
    met again inside itself (recursion) counts as open there: its own kind is decided where it
    was first met."""
    busy = set() if busy is None else busy
    if depth > 64:
        return _few("item schemas nested deeper than 64 levels")
    flat = c.flatten(schema, pointer)
    if flat is True or (isinstance(flat, dict) and all(is_annotation(k) for k in flat)):
        return ItemKind(open=True, covers={"string", "number", "object", "array"})
    if flat is False:
        return ItemKind(values=[])
    if id(flat) in busy:
        return ItemKind(open=True)
    busy.add(id(flat))
    try:
        return _flat_kind(c, flat, pointer, depth, busy)
    finally:
        busy.discard(id(flat))


def _flat_kind(c: Compiler, flat: dict[str, Any], pointer: str, depth: int, busy: set[int]) -> ItemKind:
    vals = values(flat)
    if vals is not None:
        keep = value_predicate(c, flat, pointer, own_enum="const" not in flat)
        return _listed([v for v in vals if keep(v)])
    for key in ("if", "then", "else", "contains", "unevaluatedItems", "unevaluatedProperties", "$dynamicRef"):
        if key in flat:
            return _few(f"'{key}' in an item schema")
    rest = {k: v for k, v in flat.items() if k not in ("anyOf", "oneOf")}
    if "anyOf" in flat or "oneOf" in flat:
        if "anyOf" in flat and "oneOf" in flat:
            return _few("anyOf beside oneOf in an item schema")
        word = "anyOf" if "anyOf" in flat else "oneOf"
        merged = [c.merge(rest, b, f"{pointer}/{word}/{i}") for i, b in enumerate(flat[word])]
        if word == "oneOf" and not pairwise_disjoint(c, merged):
            # Values shared by two branches are excluded: fewer values left than either suggests.
            return _few("oneOf branches not provably disjoint in an item schema")
        return _union(
            [item_kind(c, m, f"{pointer}/{word}/{i}", depth + 1, busy) for i, m in enumerate(merged)]
        )
    nots = flat.get("not")
    if nots is not None:
        excluded = c.flatten(nots, f"{pointer}/not")
        if not (isinstance(excluded, dict) and values(excluded) is not None and len(excluded) <= 2):
            return _few("'not' in an item schema (other than excluding listed values)")
        kind = item_kind(c, {k: v for k, v in flat.items() if k != "not"}, pointer, depth + 1, busy)
        # Excluding finitely many values leaves an unbounded set unbounded.
        return kind if kind.open and kind.limit is None else _few("'not' in an item schema with few values")
    types = type_set(flat)
    allowed = (
        sorted(types) if types is not None else ["null", "boolean", "object", "array", "string", "number"]
    )
    kinds: list[ItemKind] = []
    for t in allowed:
        if t == "null":
            kinds.append(_listed([None]))
        elif t == "boolean":
            kinds.append(_listed([False, True]))
        elif t == "string":
            kinds.append(_string_kind(c, flat, pointer))
        elif t in ("number", "integer"):
            if t == "integer" and "number" in allowed:
                continue
            kinds.append(_number_kind(c, flat, t, pointer))
        elif t == "object":
            kinds.append(_object_kind(c, flat, pointer, depth, busy))
        elif t == "array":
            kinds.append(_array_kind(flat))
    return _union(kinds)


def _string_kind(c: Compiler, flat: dict[str, Any], pointer: str) -> ItemKind:
    if "maxLength" in flat:
        # At the maximum length the closing quote is forced inside the string, where the mask
        # does not look (and a partial escape there leaves 16 values).
        return _few("maxLength on a string item: at its maximum length only its end is left", "string")
    fmt = flat.get("format")
    if fmt is not None and not is_unknown_format(fmt):
        return _few(f"format {fmt!r} on a string item: a begun value can have few completions", "string")
    if flat.get("__not_patterns") or flat.get("__not_values"):
        return _few("a negated pattern or value on a string item", "string")
    pats = flat.get("pattern")
    if pats is None:
        return ItemKind(open=True, covers={"string"})
    if not isinstance(pats, str) or not _unbounded_everywhere(c.pattern_dfa(pats, f"{pointer}/pattern")):
        return _few(f"pattern {pats!r} on a string item: some begun values have few completions", "string")
    return ItemKind(open=True)


def _number_kind(c: Compiler, flat: dict[str, Any], t: str, pointer: str) -> ItemKind:
    # A bound on one side only that keeps out every value of the other sign (minimum >= 0,
    # maximum <= 0): every begun value can grow without end away from zero. Anything else (a
    # maximum above zero, a minimum below it, a decimal multipleOf) can leave a begun value few
    # completions (`1` under maximum 15: 1 and 10 to 15).
    lo, _, hi, _ = number_bounds(flat, pointer)
    step = flat.get("multipleOf")
    unbounded = (
        (lo is None or (hi is None and lo >= 0))
        and (hi is None or (lo is None and hi <= 0))
        and (step is None or (isinstance(step, int | float) and float(step).is_integer()))
    )
    if not unbounded:
        return _few(
            f"bounds or a decimal multipleOf on a {t} item: a begun value can have few completions", t
        )
    if c.numbers == "float64":
        return ItemKind(open=True, limit=FLOAT64_NUMBER_CHOICES)
    if lo is not None or hi is not None or step is not None:
        return ItemKind(open=True)
    return ItemKind(open=True, covers={t})


def _object_kind(c: Compiler, flat: dict[str, Any], pointer: str, depth: int, busy: set[int]) -> ItemKind:
    for key in ("maxProperties", "propertyNames", "dependentSchemas"):
        if key in flat:
            return _few(f"'{key}' on an object item", "object")
    extra = flat.get("additionalProperties", True)
    pats = flat.get("patternProperties") or {}
    if extra is not False or any(v is not False and _infinite(c, p, pointer) for p, v in pats.items()):
        # Another member can always be added: unboundedly many values before the closing brace.
        return ItemKind(open=True)
    if "dependentRequired" in flat:
        return _few("'dependentRequired' on an object item without additional members", "object")
    props = flat.get("properties") or {}
    if not isinstance(props, dict):
        return _few("properties is not an object", "object")
    # A member with few values must be followed by one with unboundedly many in each order the
    # object may take (objects.py): after it the object could otherwise be complete but for a
    # forced tail, or a few choices.
    names = list(props) + [r for r in flat.get("required", []) if r not in props]
    kinds = {
        name: item_kind(c, props[name], f"{pointer}/properties/{name}", depth + 1, busy) for name in props
    }
    orders = [list(props)]
    again = required_first(names, flat.get("required", []))
    if again is not None:
        orders.append([names[i] for i in again if names[i] in props])
    limit: int | None = None
    for order in orders:
        opened = False
        for name in reversed(order):
            kind = kinds[name]
            if kind.open:
                opened = True
                if kind.limit is not None:
                    limit = kind.limit if limit is None else min(limit, kind.limit)
            elif not opened:
                return _few(
                    f"member {name!r} of an object item without additional members has few values "
                    "and can come after every member that has more",
                    "object",
                )
        if not opened:
            return _few("an object item without additional members has finitely many values", "object")
    return ItemKind(open=True, limit=limit)


def _array_kind(flat: dict[str, Any]) -> ItemKind:
    # Another element can always be added, unless a count or uniqueness stops it.
    if "prefixItems" in flat or "maxItems" in flat or flat.get("uniqueItems") is True:
        return _few("an array item with prefixItems, maxItems or uniqueItems", "array")
    if flat.get("items", True) is False:
        return _listed([[]])
    return ItemKind(open=True)


def _unbounded_everywhere(dfa: DFA) -> bool:
    """Whether from every live state the DFA accepts infinitely many strings (a live cycle is
    reachable from each)."""
    live = live_states(dfa)
    succ = {s: {t for _, _, t in dfa.edges[s] if t in live} for s in live}
    reach = {s for s in live if _reaches_from(succ, succ[s], s)}
    changed = True
    while changed:
        changed = False
        for s in live:
            if s not in reach and succ[s] & reach:
                reach.add(s)
                changed = True
    return reach == live


def _infinite(c: Compiler, pattern: str, pointer: str) -> bool:
    """Whether infinitely many keys match ``pattern`` (a live cycle in its search automaton)."""
    dfa = c.pattern_dfa(pattern, f"{pointer}/patternProperties")
    live = live_states(dfa)
    succ = {s: {t for _, _, t in dfa.edges[s] if t in live} for s in live}
    return any(_reaches_from(succ, succ[s], s) for s in live)


def _reaches_from(succ: dict[int, set[int]], starts: set[int], goal: int) -> bool:
    stack, seen = list(starts), set()
    while stack:
        x = stack.pop()
        if x == goal:
            return True
        if x not in seen:
            seen.add(x)
            stack.extend(succ[x])
    return False


def unique_plan(
    c: Compiler, flat: dict[str, Any], pointer: str, hi: int | None
) -> tuple[str, list[Any] | None, str | None]:
    """("listed", values, None) or ("runtime", None, None), or ("refused", None, reason)."""
    prefix = flat.get("prefixItems", [])
    items = flat.get("items", flat.get("unevaluatedItems", True))
    if "contains" in flat:
        return "refused", None, "uniqueItems beside contains"
    kinds = [item_kind(c, p, f"{pointer}/prefixItems/{i}") for i, p in enumerate(prefix)]
    if items is not False:
        kinds.append(item_kind(c, items, f"{pointer}/items"))
    if not prefix and kinds and not kinds[-1].open:
        vals = kinds[-1].values
        if vals is None:
            return "refused", None, kinds[-1].reason or "the items have few completions once begun"
        if len(vals) > MAX_LISTED_VALUES:
            return (
                "refused",
                None,
                f"the items have {len(vals)} possible values, more than {MAX_LISTED_VALUES}",
            )
        return "listed", vals, None
    for i, k in enumerate(kinds):
        # The item at position i has at most i earlier ones (past the prefix: any number): the
        # first may be anything, and null/true/false (decided by their first letter) have an
        # unused one left while there are more of them than earlier items.
        if i < len(prefix) and (
            i == 0 or (k.values is not None and k.types <= {"literal"} and len(k.values) > i)
        ):
            continue
        if not k.open:
            return "refused", None, k.reason or f"prefixItems/{i} has few values beside uniqueItems"
        if k.limit is not None and (hi is None or hi > k.limit):
            return (
                "refused",
                None,
                f"under the float64 number policy a begun number can have {k.limit} completions left, "
                f"and maxItems is {'absent' if hi is None else hi}",
            )
    return "runtime", None, None


def unique_item(c: Compiler, item: Expr, pointer: str) -> Expr:
    """A reference to the :class:`UniqueItem` rule around ``item`` (one per distinct item)."""
    return c.shared_rule(f"{pointer}-unique", UniqueItem(item))


def listed_unique_array(
    c: Compiler, vals: list[Any], lo: int, hi: int | None, pointer: str, depth: int
) -> Expr:
    """Arrays of distinct values from ``vals``, between ``lo`` and ``hi`` of them: one rule per set
    of values used so far."""
    n = len(vals)
    top = n if hi is None else min(hi, n)
    if lo > top:
        return Alt(())
    if top == 0:
        return c.empty("[", "]")
    exprs = [value_expr(c, v, depth + 1) for v in vals]
    sep = c.sep(depth)
    memo: dict[int, Expr] = {}

    def state(used: int) -> Expr:
        if used in memo:
            return memo[used]
        count = bin(used).count("1")
        options: list[Expr] = [Empty()] if count >= lo else []
        if count < top:
            options.extend(seq(sep, exprs[i], state(used | 1 << i)) for i in range(n) if not used >> i & 1)
        name = c.add_rule(f"{pointer}-u{used}", options[0] if len(options) == 1 else Alt(tuple(options)))
        memo[used] = Ref(name)
        return memo[used]

    body = Alt(tuple(seq(exprs[i], state(1 << i)) for i in range(n)))
    return c.container("[", "]", body, lo == 0, depth)
