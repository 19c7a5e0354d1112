"""Arrays: ``prefixItems``, ``items``, ``minItems``/``maxItems``, the plain form of ``contains`` and
``uniqueItems`` (:mod:`.unique_items`), as counted repeats of the element rules with the
separators between them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_infer.grammar.frontends.json_schema.applicators.merge import all_of
from agent_infer.grammar.frontends.json_schema.types.bounds import count
from agent_infer.grammar.frontends.json_schema.types.unique_items import (
    listed_unique_array,
    unique_item,
    unique_plan,
)
from agent_infer.grammar.ir import Alt, Empty, Expr, Ref, alt, opt, seq, star

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler


def _never() -> Expr:
    return Alt(())


def _item(c: Compiler, schema: Any, pointer: str, depth: int, unique: bool) -> Expr:
    expr = c.lower(schema, pointer, depth + 1)
    return unique_item(c, expr, pointer) if unique else expr


# Counting states of a contains array (hits counted to minContains or maxContains, items to
# minItems or maxItems): past this, UnsupportedSchemaError.
MAX_CONTAINS_STATES = 4000


def _counting_states(least: int, most: int | None, lo: int, hi: int | None) -> int:
    """Rules :func:`_counted_contains` writes at most: hits up to ``most`` (or ``least``, where
    they saturate) times items up to ``hi`` (or ``lo``)."""
    return ((most if most is not None else least) + 1) * ((hi if hi is not None else max(lo, 1)) + 1)


def _counted_contains(
    c: Compiler,
    items: Any,
    contains: Any,
    counts: tuple[int, int | None, int, int | None],
    pointer: str,
    depth: int,
    unique: bool,
) -> Expr:
    """An array with ``counts`` = (least, most) items matching ``contains`` and (lo, hi) items in
    all: items that match it (``hit``) and items that do not (``miss``, its complement lowered as
    a ``not``, exact or refused), read by one rule per (hits, items) seen so far, each count
    saturating where no bound above it remains."""
    least, most, lo, hi = counts
    if (most is not None and most < least) or (hi is not None and (hi < lo or hi < least)):
        return _never()
    top_h = most if most is not None else least
    top_t = hi if hi is not None else max(lo, 1)
    sep = c.sep(depth)
    hit = _item(c, all_of(items, contains), f"{pointer}/contains", depth, unique)
    miss = _item(c, all_of(items, {"not": contains}), f"{pointer}/contains", depth, unique)
    names: dict[tuple[int, int], str] = {}
    todo: list[tuple[int, int]] = []

    def state(h: int, t: int) -> Ref:
        key = (min(h, top_h), min(t, top_t))
        if key not in names:
            names[key] = c.fresh(f"{pointer}-contains-{key[0]}-{key[1]}")
            todo.append(key)
        return Ref(names[key])

    first: list[Expr] = []
    if hi is None or hi >= 1:
        if most is None or most >= 1:
            first.append(seq(hit, state(1, 1)))
        first.append(seq(miss, state(0, 1)))
    while todo:  # a worklist, not recursion: up to MAX_CONTAINS_STATES rules
        h, t = todo.pop()
        ways: list[Expr] = []
        if h >= least and t >= lo:
            ways.append(Empty())
        if hi is None or t < hi:
            if most is None or h < most:
                ways.append(seq(sep, hit, state(h + 1, t + 1)))
            ways.append(seq(sep, miss, state(h, t + 1)))
        c.rules[names[(h, t)]] = alt(*ways)
    return c.container("[", "]", alt(*first), least == 0 and lo == 0, depth)


def lower_array(c: Compiler, flat: dict[str, Any], pointer: str, depth: int) -> Expr:
    """An array under prefixItems/items/minItems/maxItems/contains/uniqueItems."""
    prefix = flat.get("prefixItems", [])
    items = flat.get("items", flat.get("unevaluatedItems", True))
    lo = count(flat, "minItems", pointer) or 0
    hi = count(flat, "maxItems", pointer)
    if items is False:
        hi = len(prefix) if hi is None else min(hi, len(prefix))
    if hi is not None and hi < lo:
        return _never()
    unique = flat.get("uniqueItems") is True and not (hi is not None and hi <= 1)
    if unique:
        plan, listed, reason = unique_plan(c, flat, pointer, hi)
        if plan == "listed":
            assert listed is not None
            return listed_unique_array(c, listed, lo, hi, pointer, depth)
        if plan == "refused":
            c.unsupported("uniqueItems", f"{pointer}/uniqueItems", f"uniqueItems not enforceable: {reason}")
            unique = False  # non-strict: the items unconstrained by it
    sep = c.sep(depth)
    contains = flat.get("contains")
    min_contains = count(flat, "minContains", pointer)
    max_contains = count(flat, "maxContains", pointer)
    if contains is not None and (min_contains != 0 or max_contains is not None):
        least = 1 if min_contains is None else min_contains
        if prefix:
            c.unsupported("contains", f"{pointer}/contains", "contains beside prefixItems is not supported")
        elif least == 1 and max_contains is None and lo <= 1 and hi is None:
            item = _item(c, items, f"{pointer}/items", depth, unique)
            hit = _item(c, all_of(items, contains), f"{pointer}/contains", depth, unique)
            body = seq(star(seq(item, sep)), hit, star(seq(sep, item)))
            return c.container("[", "]", body, False, depth)
        elif _counting_states(least, max_contains, lo, hi) > MAX_CONTAINS_STATES:
            c.unsupported(
                "contains",
                f"{pointer}/contains",
                f"contains counts need more than {MAX_CONTAINS_STATES} counting states",
            )
        else:
            return _counted_contains(
                c, items, contains, (least, max_contains, lo, hi), pointer, depth, unique
            )
    elems = [c.lower(p, f"{pointer}/prefixItems/{i}", depth + 1) for i, p in enumerate(prefix)]
    m = len(elems)
    item_expr = c.lower(items, f"{pointer}/items", depth + 1) if items is not False else _never()
    if unique:
        elems = [unique_item(c, e, f"{pointer}/prefixItems/{i}") for i, e in enumerate(elems)]
        if items is not False:
            item_expr = unique_item(c, item_expr, f"{pointer}/items")
    r_min = max(0, lo - m)
    r_max = None if hi is None else max(0, hi - m)
    # rest after at least one element: more items, each preceded by a separator
    rest: Expr = (
        c.repeat(seq(sep, item_expr), r_min, r_max) if r_max != 0 else (Empty() if r_min == 0 else _never())
    )
    first_tail: Expr | None = None
    if hi == 0:
        return c.empty("[", "]")
    if m == 0:
        if r_max == 0:
            return c.empty("[", "]") if lo == 0 else _never()
        more = c.repeat(seq(sep, item_expr), max(r_min - 1, 0), None if r_max is None else r_max - 1)
        return c.container("[", "]", seq(item_expr, more), lo == 0, depth)
    for i in range(m - 1, -1, -1):
        if hi is not None and i >= hi:
            rest = Empty()
            continue
        step = seq(elems[i], rest)
        if i == 0:
            first_tail = step
        else:
            rest = seq(sep, step) if i < lo else opt(seq(sep, step))
    assert first_tail is not None
    return c.container("[", "]", first_tail, lo == 0, depth)
