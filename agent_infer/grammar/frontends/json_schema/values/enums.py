"""``enum``/``const``: the listed values that also satisfy every sibling keyword, each written as
the JSON texts equal to it (numbers in any fraction form, small objects in any key order)."""

from __future__ import annotations

import itertools
import json
from typing import TYPE_CHECKING, Any

from agent_infer.grammar.frontends.json_schema.types import numerals as num
from agent_infer.grammar.frontends.json_schema.types.string_encoding import encode_literal
from agent_infer.grammar.frontends.json_schema.values.canon import canon, to_fraction
from agent_infer.grammar.frontends.json_schema.values.validation import value_predicate
from agent_infer.grammar.ir import Alt, Expr, Literal, alt, lit, seq

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler


def value_expr(c: Compiler, v: Any, depth: int) -> Expr:
    """JSON texts equal to ``v`` (numbers in any fraction form, small objects in any key order)."""
    if v is None:
        return lit("null")
    if isinstance(v, bool):
        return lit("true" if v else "false")
    if isinstance(v, int | float):
        f = to_fraction(v)
        return num.bounded_number(f, False, f, False, False) or lit(json.dumps(v))
    if isinstance(v, str):
        return _string_value(v)
    if isinstance(v, list):
        if not v:
            return c.empty("[", "]")
        items = [value_expr(c, x, depth + 1) for x in v]
        body = seq(items[0], *(seq(c.sep(depth), x) for x in items[1:]))
        return c.container("[", "]", body, False, depth)
    if isinstance(v, dict):
        if not v:
            return c.empty("{", "}")
        members = [
            seq(lit('"'), encode_literal(k), lit('"'), c.colon(), value_expr(c, x, depth + 1))
            for k, x in v.items()
        ]
        orders = itertools.permutations(members) if len(members) <= 3 else [members]
        bodies = [seq(o[0], *(seq(c.sep(depth), m) for m in o[1:])) for o in orders]
        return c.container("{", "}", alt(*bodies), False, depth)
    raise TypeError(f"not a JSON value: {v!r}")


def lower_values(
    c: Compiler, vals: list[Any], flat: dict[str, Any], pointer: str, depth: int, *, own_enum: bool = False
) -> Expr:
    """enum/const: the listed values that also satisfy every sibling keyword (decided per value).
    ``own_enum``: ``vals`` is ``flat``'s own ``enum`` (no ``const``), so membership is given."""

    valid = value_predicate(c, flat, pointer, own_enum=own_enum)
    keep = []
    seen = set()
    strings = True
    for v in vals:
        # Strings are their own key (canon's keys are tuples, never equal to a str): generated
        # enums list thousands of codes.
        key = v if type(v) is str else canon(v)
        if key not in seen:
            seen.add(key)
            if valid(v):
                keep.append(v)
                strings = strings and type(v) is str
    if not keep:
        return Alt(())
    if strings:
        # Distinct strings have distinct encodings, and none is an alternation: alt() would find
        # nothing to flatten or drop, only hash every value's expression to be sure.
        exprs = [_string_value(v) for v in keep]
        return exprs[0] if len(exprs) == 1 else Alt(tuple(exprs))
    numbers = [v for v in keep if type(v) is int or type(v) is float]
    if len(numbers) < 2:
        return alt(*(value_expr(c, v, depth) for v in keep))
    rest = [value_expr(c, v, depth) for v in keep if not (type(v) is int or type(v) is float)]
    return alt(num.listed_numbers([to_fraction(v) for v in numbers], [json.dumps(v) for v in numbers]), *rest)


def _string_value(v: str) -> Expr:
    """``value_expr`` of a string; printable ASCII is one literal with its quotes."""
    if v.isascii() and v.isprintable() and '"' not in v and "\\" not in v and "/" not in v:
        return Literal(f'"{v}"')
    return seq(lit('"'), encode_literal(v), lit('"'))
