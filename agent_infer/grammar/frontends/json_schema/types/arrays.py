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
from agent_infer.grammar.ir import Alt, Empty, Expr, opt, seq, star

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler


def _never() -> Expr:
    return Alt(())


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
    if contains is not None and min_contains == 0 and "maxContains" in flat:
        c.unsupported("maxContains", f"{pointer}/maxContains", "maxContains is not supported")
    if contains is not None and min_contains != 0:
        if prefix or "maxContains" in flat or (min_contains or 1) != 1 or lo > 1 or hi is not None:
            c.unsupported("contains", f"{pointer}/contains", "contains is only supported in its plain form")
        else:
            item = c.lower(items, f"{pointer}/items", depth + 1)
            hit = c.lower(all_of(items, contains), f"{pointer}/contains", depth + 1)
            body = seq(star(seq(item, sep)), hit, star(seq(sep, item)))
            return c.container("[", "]", body, False, depth)
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
