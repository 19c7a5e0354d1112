"""Complements of simple schemas, so ``not``, ``if``/``then``/``else`` and overlapping ``oneOf`` lower exactly.

``not S`` is rewritten as ``anyOf`` over the negations of S's keywords (De Morgan): each keyword
only constrains instances of its own type, so its negation is "of that type and violating it". A
keyword without an expressible complement (``items``, ``format``, numeric ``enum`` values, ...)
makes :func:`negate` return None and the caller reports the construct as unsupported.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_infer.grammar.frontends.json_schema.applicators.disjoint import disjoint, patterns_oracle
from agent_infer.grammar.frontends.json_schema.keywords import KNOWN, is_annotation
from agent_infer.grammar.frontends.json_schema.types.formats import is_unknown_format

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler

_BOUND_FLIP = {
    "minimum": "exclusiveMaximum",
    "maximum": "exclusiveMinimum",
    "exclusiveMinimum": "maximum",
    "exclusiveMaximum": "minimum",
}
_COUNT_FLIP = {
    "minLength": ("string", "maxLength", -1),
    "maxLength": ("string", "minLength", 1),
    "minItems": ("array", "maxItems", -1),
    "maxItems": ("array", "minItems", 1),
    "minProperties": ("object", "maxProperties", -1),
    "maxProperties": ("object", "minProperties", 1),
}
MAX_DEPTH = 8
# A negated oneOf is "none, or some overlapping pair": n complements plus the pairs' intersections.
MAX_ONE_OF_NEGATED = 8
MAX_ONE_OF_PAIRS = 6
# Listed numbers, arrays and objects one complement excludes (each adds an anyOf to multiply out).
MAX_NEGATED_VALUES = 4
# Nesting of one excluded value (its complement grows linearly with it).
MAX_VALUE_DEPTH = 64


def _any(parts: list[Any]) -> Any:
    parts = [p for p in parts if p is not False]
    if not parts:
        return False
    if any(p is True for p in parts):
        return True
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


def negate(
    c: Compiler, schema: Any, pointer: str, depth: int = 0, active: frozenset[str] = frozenset()
) -> Any | None:
    """A schema valid exactly for the instances ``schema`` rejects, or None if not expressible.

    ``active``: the ``$ref`` targets being negated further out. A recursive schema meets one of
    them again; its complement is then left as ``{"not": {"$ref": ...}}``, lowered (and memoized
    by structure, so the recursion closes) like any other ``not``; so is a complement deeper than
    MAX_DEPTH. Such a deferred complement that turns out inexpressible is reported where it is
    lowered."""
    ref = schema.get("$ref") if isinstance(schema, dict) and len(schema) == 1 else None
    if isinstance(ref, str):
        if ref in active:
            return {"not": schema}
        active = active | {ref}
    if depth > MAX_DEPTH:
        # Deep complements are built when (and if) their part is lowered, from depth 0 again.
        return {"not": schema}
    flat = c.flatten(schema, pointer)
    if isinstance(flat, bool):
        return not flat
    parts: list[Any] = []
    for key, v in flat.items():
        if key == "__not_types":
            parts.append({"type": list(v)})
            continue
        if key.startswith("__"):
            return None  # other internal forms (conditionals, exclusions) are not negated
        if is_annotation(key):
            continue
        if key not in KNOWN:
            # An annotation: it rejects nothing, so its complement adds no instance.
            c.unknown_keyword(key, f"{pointer}/{key}")
            continue
        if key == "format" and is_unknown_format(v):
            c.unknown_format(v, f"{pointer}/format")
            continue
        part = _negate_keyword(c, key, v, flat, pointer, depth, active)
        if part is None:
            return None
        parts.append(part)
    return _any(parts)


def _negate_keyword(
    c: Compiler, key: str, v: Any, flat: dict[str, Any], pointer: str, depth: int, active: frozenset[str]
) -> Any | None:
    if key == "type":
        return {"not": {"type": v}}
    if key == "required":
        return _any([{"type": "object", "properties": {name: False}} for name in v])
    if key == "properties":
        out = []
        for name, sub in v.items():
            neg = negate(c, sub, f"{pointer}/properties/{name}", depth + 1, active)
            if neg is None:
                return None
            out.append({"type": "object", "required": [name], "properties": {name: neg}})
        return _any(out)
    if key in ("const", "enum"):
        vals = [v] if key == "const" else list(v)
        scalars = [x for x in vals if isinstance(x, str | bool) or x is None]
        others = [x for x in vals if not (isinstance(x, str | bool) or x is None)]
        if len(others) > MAX_NEGATED_VALUES:
            return None
        parts = [_not_value(x, 0) for x in others]
        if any(p is None for p in parts):
            return None
        if scalars:
            parts.insert(0, {"__not_values": scalars})
        return parts[0] if len(parts) == 1 else {"allOf": parts}
    if key in _BOUND_FLIP:
        return {"type": "number", _BOUND_FLIP[key]: v}
    if key in _COUNT_FLIP:
        typ, other, delta = _COUNT_FLIP[key]
        bound = int(v) + delta
        return False if bound < 0 else {"type": typ, other: bound}
    if key == "pattern" and isinstance(v, str):
        return {"type": "string", "__not_patterns": [v]}
    if key == "not":
        return v
    if key == "anyOf":
        negs = [negate(c, b, f"{pointer}/anyOf/{i}", depth + 1, active) for i, b in enumerate(v)]
        return None if any(n is None for n in negs) else {"allOf": negs}
    if key == "oneOf":
        return _negate_one_of(c, v, pointer, depth, active)
    if key == "items" and "prefixItems" not in flat:
        neg = negate(c, v, f"{pointer}/items", depth + 1, active)
        # Some item violates the item schema: the plain form of contains.
        return None if neg is None else (False if neg is False else {"type": "array", "contains": neg})
    if key == "contains" and "minContains" not in flat and "maxContains" not in flat:
        neg = negate(c, v, f"{pointer}/contains", depth + 1, active)
        # No item satisfies it: every item (prefix positions included) is in its complement.
        return None if neg is None else {"type": "array", "items": neg}
    if key in ("minContains", "maxContains") and "contains" not in flat:
        return False  # without contains they assert nothing
    if key == "prefixItems" and "items" not in flat and isinstance(v, list):
        return _negate_prefix(c, v, pointer, depth, active)
    if key == "additionalProperties" and not flat.get("patternProperties"):
        neg = negate(c, v, f"{pointer}/additionalProperties", depth + 1, active)
        if neg is None or neg is False:
            return neg
        # Some member outside the declared names violates additionalProperties (types/objects.py).
        return {
            "type": "object",
            "__some_members": [{"outside": list(flat.get("properties", {})), "value": neg}],
        }
    return None


def _not_value(x: Any, depth: int) -> Any | None:
    """Every value but ``x`` (a number, array or object), by bounds, lengths and members: a
    number has many spellings (``1``, ``1.0``), so "not equal" is "less or greater"."""
    if depth > MAX_VALUE_DEPTH:
        return None
    if isinstance(x, int | float):
        return {
            "anyOf": [
                {"not": {"type": "number"}},
                {"type": "number", "exclusiveMaximum": x},
                {"type": "number", "exclusiveMinimum": x},
            ]
        }
    if isinstance(x, list):
        parts: list[Any] = [{"not": {"type": "array"}}, {"type": "array", "minItems": len(x) + 1}]
        if x:
            parts.append({"type": "array", "maxItems": len(x) - 1})
        for i, item in enumerate(x):
            neg = _not_value(item, depth + 1) if _container_or_number(item) else {"__not_values": [item]}
            if neg is None:
                return None
            parts.append({"type": "array", "minItems": i + 1, "prefixItems": [True] * i + [neg]})
        return {"anyOf": parts}
    if isinstance(x, dict):
        parts = [{"not": {"type": "object"}}]
        # A member x does not have, or one it has missing, or one of its members with another value.
        parts.append({"type": "object", "__some_members": [{"outside": list(x), "value": True}]})
        for name, item in x.items():
            parts.append({"type": "object", "properties": {name: False}})
            neg = _not_value(item, depth + 1) if _container_or_number(item) else {"__not_values": [item]}
            if neg is None:
                return None
            parts.append({"type": "object", "required": [name], "properties": {name: neg}})
        return {"anyOf": parts}
    return None


def _container_or_number(x: Any) -> bool:
    return isinstance(x, int | float | list | dict) and not isinstance(x, bool)


def _negate_one_of(
    c: Compiler, branches: list[Any], pointer: str, depth: int, active: frozenset[str]
) -> Any | None:
    """Not exactly one branch: none of them, or some two of them (only pairs not proved disjoint)."""
    if not isinstance(branches, list) or len(branches) > MAX_ONE_OF_NEGATED:
        return None
    negs = [negate(c, b, f"{pointer}/oneOf/{i}", depth + 1, active) for i, b in enumerate(branches)]
    if any(n is None for n in negs):
        return None

    def flat(s: Any) -> Any:
        return c.flatten(s, pointer)

    flats = [flat(b) for b in branches]
    pairs = [
        {"allOf": [a, b]}
        for i, a in enumerate(branches)
        for j, b in enumerate(branches[i + 1 :], i + 1)
        if not disjoint(
            flats[i], flats[j], flat, c.matches, 0, patterns_oracle(lambda p: c.pattern_dfa(p, pointer))
        )
    ]
    if len(pairs) > MAX_ONE_OF_PAIRS:
        return None
    return _any([{"allOf": negs}, *pairs])


def _negate_prefix(
    c: Compiler, prefix: list[Any], pointer: str, depth: int, active: frozenset[str]
) -> Any | None:
    """Some position i (present in the array) violates ``prefixItems[i]``."""
    parts: list[Any] = []
    for i, sub in enumerate(prefix):
        neg = negate(c, sub, f"{pointer}/prefixItems/{i}", depth + 1, active)
        if neg is None:
            return None
        if neg is not False:
            parts.append({"type": "array", "minItems": i + 1, "prefixItems": [True] * i + [neg]})
    return _any(parts)
