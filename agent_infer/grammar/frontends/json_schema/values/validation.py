"""Deciding whether one concrete JSON value satisfies a schema (for ``enum``/``const`` filtering).

When a schema lists its values, every other keyword only filters that finite list, so even keywords
a grammar cannot express (``not``, ``oneOf``, ``if``/``then``/``else``, ``uniqueItems``,
``dependentRequired``/``dependentSchemas``) are decided exactly, per value, here. The remaining
keywords are checked by running the schema's own (strict) grammar on the value's JSON text.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agent_infer.errors import GrammarLimitError
from agent_infer.grammar.frontends.json_schema.keywords import KNOWN, TYPES, is_annotation
from agent_infer.grammar.frontends.json_schema.types.bounds import count
from agent_infer.grammar.frontends.json_schema.values.canon import canon

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler

_LOGIC = (
    "not",
    "anyOf",
    "oneOf",
    "__all_of",
    "__conditionals",
    "uniqueItems",
    "dependentRequired",
    "dependentSchemas",
    "enum",
    "const",
    "__some_members",
    "__more_one_of",
)
MAX_DEPTH = 32


def value_valid(c: Compiler, schema: Any, v: Any, pointer: str, depth: int = 0) -> bool:
    """Exact validity of ``v`` under ``schema`` (raises UnsupportedSchemaError like strict lowering)."""
    if depth > MAX_DEPTH:
        raise GrammarLimitError(
            f"schema nesting deeper than {MAX_DEPTH} while checking enum values at {pointer}"
        )
    flat = c.flatten(schema, pointer)
    if isinstance(flat, bool):
        return flat
    # const and enum are separate assertions: a value listed by one must be allowed by the other.
    if "const" in flat and canon(v) != canon(flat["const"]):
        return False
    if "enum" in flat and canon(v) not in _canon_set(c, flat["enum"]):
        return False

    def sub(s: Any, where: str) -> bool:
        return value_valid(c, s, v, f"{pointer}/{where}", depth + 1)

    if "not" in flat and sub(flat["not"], "not"):
        return False
    if "anyOf" in flat and not any(sub(b, f"anyOf/{i}") for i, b in enumerate(flat["anyOf"])):
        return False
    if not all(sub(part, "allOf") for part in flat.get("__all_of", [])):
        return False
    for one_of in [flat["oneOf"]] if "oneOf" in flat else []:
        if sum(sub(b, f"oneOf/{i}") for i, b in enumerate(one_of)) != 1:
            return False
    for one_of in flat.get("__more_one_of", []):
        if sum(sub(b, f"oneOf/{i}") for i, b in enumerate(one_of)) != 1:
            return False
    for cond in flat.get("__conditionals", []):
        branch = "then" if sub(cond["if"], "if") else "else"
        if not sub(cond[branch], branch):
            return False
    if flat.get("uniqueItems") is True and isinstance(v, list) and len({canon(x) for x in v}) != len(v):
        return False
    if isinstance(v, dict):
        for need in flat.get("__some_members", []):
            outside = set(need["outside"])
            hit = need["value"]
            if not any(
                k not in outside and value_valid(c, hit, x, f"{pointer}/additionalProperties", depth + 1)
                for k, x in v.items()
            ):
                return False
        for trigger, deps in flat.get("dependentRequired", {}).items():
            if trigger in v and any(d not in v for d in deps):
                return False
        for trigger, dep in flat.get("dependentSchemas", {}).items():
            if trigger in v and not sub(dep, f"dependentSchemas/{trigger}"):
                return False
    rest = {k: x for k, x in flat.items() if k not in _LOGIC and not is_annotation(k)}
    if not rest:
        return True
    by_type = answer_by_type(rest, v)
    if by_type is not None:
        return by_type
    if _is_container(v):
        by_members = _container_valid(c, rest, v, pointer, depth)
        if by_members is not None:
            return by_members
    unknown = [k for k in rest if k not in KNOWN and not k.startswith("__")]
    if _typed_unknown(rest, unknown):
        # {"type": ..., <unknown keywords>} or unknown keywords alone: the unknown ones are
        # annotations to the grammar (noted or refused as its compile would), so the type alone
        # decides a scalar (no type: any value), without compiling a grammar and a recognizer for
        # it (enums in generated schemas often sit next to tool-specific keywords).
        return c.typed_matcher(rest, unknown, pointer)(v)
    return c.value_matcher(rest, pointer, strict=c.strict, record=True)(v)


def value_predicate(
    c: Compiler, schema: Any, pointer: str, *, own_enum: bool = False
) -> Callable[[Any], bool]:
    """``lambda v: value_valid(c, schema, v, pointer)`` with the work that does not depend on ``v``
    done once: long enums (thousands of codes next to a ``type``) are filtered value by value.
    ``own_enum``: every value asked about comes from the schema's own ``enum`` and there is no
    ``const``, so membership need not be checked."""
    flat = c.flatten(schema, pointer)
    if isinstance(flat, bool):
        return lambda v: flat
    if any(k in flat for k in _LOGIC if k not in ("enum", "const")):
        return lambda v: value_valid(c, flat, v, pointer)
    has_const = "const" in flat
    const = canon(flat["const"]) if has_const else None
    allowed = _canon_set(c, flat["enum"]) if "enum" in flat and not (own_enum and not has_const) else None
    rest = {k: x for k, x in flat.items() if k not in _LOGIC and not is_annotation(k)}
    unknown = [k for k in rest if k not in KNOWN and not k.startswith("__")]
    typed_unknown = _typed_unknown(rest, unknown)
    lengths = _string_lengths(rest)
    typed = {"type": rest["type"]} if "type" in rest else None
    # answer_by_type's answer for a string, null or boolean depends on its kind alone.
    by_kind: dict[type, bool] = {}
    # Built on the first value that needs it, as value_valid would (it records warnings).
    slow: list[Callable[[Any], bool]] = []

    def type_verdict(v: Any) -> bool | None:
        kind = type(v)
        hit = by_kind.get(kind)
        if hit is not None:
            return hit
        if lengths is None:
            verdict = answer_by_type(rest, v)
        else:
            verdict = True if typed is None else answer_by_type(typed, v)
        if verdict is not None and (kind is str or kind is bool or v is None):
            by_kind[kind] = verdict
        return verdict

    def accepts(v: Any) -> bool:
        if has_const or allowed is not None:
            key = canon(v)
            if (has_const and key != const) or (allowed is not None and key not in allowed):
                return False
        if not rest:
            return True
        verdict = type_verdict(v)
        if verdict is not None:
            if not verdict or lengths is None or type(v) is not str:
                return verdict
            n = _code_points(v)
            if n is not None:
                return lengths[0] <= n and (lengths[1] is None or n <= lengths[1])
        if _is_container(v):
            by_members = _container_valid(c, rest, v, pointer, 0)
            if by_members is not None:
                return by_members
        if not slow:
            slow.append(
                c.typed_matcher(rest, unknown, pointer)
                if typed_unknown
                else c.value_matcher(rest, pointer, strict=c.strict, record=True)
            )
        return slow[0](v)

    return accepts


def _is_container(v: Any) -> bool:
    """Whether ``v`` is a JSON object or array (decided member by member, not by a grammar)."""
    return type(v) is dict or type(v) is list


# Keywords that constrain only objects, only arrays, and only scalars (ignored by the others).
_OBJECT = frozenset(
    (
        "properties",
        "patternProperties",
        "additionalProperties",
        "required",
        "propertyNames",
        "minProperties",
        "maxProperties",
    )
)
_ARRAY = frozenset(("prefixItems", "items", "contains", "minContains", "maxContains", "minItems", "maxItems"))
_SCALAR = frozenset(
    (
        "minLength",
        "maxLength",
        "pattern",
        "format",
        "contentEncoding",
        "contentMediaType",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
        "multipleOf",
    )
)


def _container_valid(c: Compiler, rest: dict[str, Any], v: Any, pointer: str, depth: int) -> bool | None:
    """Validity of an object or array ``v`` under ``rest`` (no logic keywords), member by member:
    the grammar of ``rest`` takes members in one declared order only, so a check against it would
    turn that documented false negative into a wrong answer (and under ``not``/``oneOf`` into a
    wrong acceptance). None: ``rest`` has a keyword decided here for no container (the grammar
    check decides)."""
    is_dict = type(v) is dict
    own = _OBJECT if is_dict else _ARRAY
    other = _ARRAY if is_dict else _OBJECT
    if any(k != "type" and k not in own and k not in other and k not in _SCALAR for k in rest):
        return None
    t = rest.get("type")
    if t is not None:
        names = t if isinstance(t, list) else [t]
        if not all(isinstance(n, str) and n in TYPES for n in names):
            return None  # the grammar path reports the bad type name
        if ("object" if is_dict else "array") not in names:
            return False

    def sub(schema: Any, where: str, x: Any) -> bool:
        return value_valid(c, schema, x, f"{pointer}/{where}", depth + 1)

    if not is_dict:
        prefix = rest.get("prefixItems", [])
        items = rest.get("items", True)
        lo, hi = count(rest, "minItems", pointer) or 0, count(rest, "maxItems", pointer)
        if len(v) < lo or (hi is not None and len(v) > hi):
            return False
        for i, x in enumerate(v):
            schema, where = (prefix[i], f"prefixItems/{i}") if i < len(prefix) else (items, "items")
            if not sub(schema, where, x):
                return False
        if "contains" in rest:
            hits = sum(sub(rest["contains"], "contains", x) for x in v)
            least = count(rest, "minContains", pointer)
            most = count(rest, "maxContains", pointer)
            if hits < (1 if least is None else least) or (most is not None and hits > most):
                return False
        return True
    props = rest.get("properties", {})
    pats = rest.get("patternProperties", {})
    additional = rest.get("additionalProperties", True)
    lo, hi = count(rest, "minProperties", pointer) or 0, count(rest, "maxProperties", pointer)
    if len(v) < lo or (hi is not None and len(v) > hi):
        return False
    if any(name not in v for name in rest.get("required", [])):
        return False
    names = rest.get("propertyNames", True)
    for key, x in v.items():
        if names is not True and not sub(names, "propertyNames", key):
            return False
        matched = [p for p in pats if c.matches(p, key)]
        if key in props and not sub(props[key], f"properties/{key}", x):
            return False
        if any(not sub(pats[p], f"patternProperties/{p}", x) for p in matched):
            return False
        if key not in props and not matched and not sub(additional, "additionalProperties", x):
            return False
    return True


def _string_lengths(rest: dict[str, Any]) -> tuple[int, int | None] | None:
    """(minLength, maxLength) when ``rest`` is those and at most a ``type``, with valid counts
    (a string's length is then its number of code points; other kinds are decided by the type)."""
    if not rest or not set(rest) <= {"type", "minLength", "maxLength"} or set(rest) == {"type"}:
        return None
    lo, hi = rest.get("minLength", 0), rest.get("maxLength")
    for x in (lo, hi):
        if x is not None and (type(x) is not int or x < 0):
            return None  # the grammar path reports a bad count
    return lo, hi


def _code_points(v: str) -> int | None:
    """``len(v)``, or None if ``v`` holds a lone surrogate (not a character of any JSON text)."""
    if not v.isascii() and any("\ud800" <= ch <= "\udfff" for ch in v):
        return None
    return len(v)


def _typed_unknown(rest: dict[str, Any], unknown: list[str]) -> bool:
    """Whether ``rest`` is unknown keywords, with at most a ``type`` beside them."""
    return bool(unknown) and len(rest) - len(unknown) == ("type" in rest)


def _canon_set(c: Compiler, enum: Any) -> set[Any]:
    """``{canon(x) for x in enum}``, built once per enum list of a compile (enums are checked
    value by value against themselves: quadratic otherwise)."""
    hit = c.canon_sets.get(id(enum))
    if hit is None or hit[0] is not enum:
        hit = c.canon_sets[id(enum)] = (enum, {canon(x) for x in enum})
    return hit[1]


def answer_by_type(rest: dict[str, Any], v: Any) -> bool | None:
    """Whether a scalar ``v`` is valid under ``rest`` when that is ``{"type": ...}`` alone, decided
    without building its grammar (None: not that case). Types go by value: any JSON string, null or
    boolean of an allowed type, any integer for "integer", any finite float for "number", and an
    integral float (3.0) for "integer" too; its own grammar (``value_expr``) takes "3"."""
    if len(rest) != 1 or "type" not in rest:
        return None
    t = rest["type"]
    names = t if isinstance(t, list) else [t]
    if not all(isinstance(n, str) and n in TYPES for n in names):
        return None  # the grammar path reports the bad type name
    kind = type(v)
    if v is None:
        return "null" in names
    if kind is bool:
        return "boolean" in names
    if kind is str:
        return "string" in names
    if kind is int:
        return "integer" in names or "number" in names
    if kind is float:
        # JSON Schema types by value: 3.0 is an integer.
        return math.isfinite(v) and ("number" in names or ("integer" in names and v.is_integer()))
    return None
