"""JSON values as JSON Schema compares them: a hashable key under JSON equality, exact numbers,
type names, and compact text with plain decimals."""

from __future__ import annotations

import json
from decimal import Decimal
from fractions import Fraction
from typing import Any


def canon(v: Any) -> Any:
    """A hashable key under JSON equality (1 == 1.0, true != 1, object key order irrelevant)."""
    if isinstance(v, bool) or v is None:
        return ("c", v)
    if isinstance(v, int | float):
        return ("n", to_fraction(v))
    if isinstance(v, str):
        return ("s", v)
    if isinstance(v, list):
        return ("a", tuple(canon(x) for x in v))
    if isinstance(v, dict):
        return ("o", frozenset((k, canon(x)) for k, x in v.items()))
    return ("?", repr(v))


def to_fraction(v: int | float) -> Fraction:
    """Exact decimal value as written (floats via their shortest repr, so 0.1 is 1/10)."""
    return Fraction(v) if isinstance(v, int) else Fraction(repr(v))


def json_type(v: Any) -> str:
    """The JSON Schema type name of a value (integers, including 1.0, are "integer")."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer()):
        return "integer"
    return {float: "number", str: "string", list: "array", dict: "object"}[type(v)]


def plain_json(v: Any) -> str:
    """Compact JSON text of ``v`` with every number in plain decimal (json.dumps writes 1e-05 and
    3.0, texts a bounded or "integer" grammar does not take, though JSON Schema compares numbers
    by value: 0.00001 is at least 0, 3.0 is an integer)."""
    kind = type(v)
    if kind is float:
        if v.is_integer():
            return str(int(v))
        return format(Decimal(repr(v)), "f")
    if kind is list:
        return "[" + ",".join(plain_json(x) for x in v) + "]"
    if kind is dict:
        return (
            "{"
            + ",".join(json.dumps(k, ensure_ascii=False) + ":" + plain_json(x) for k, x in v.items())
            + "}"
        )
    return json.dumps(v, ensure_ascii=False)
