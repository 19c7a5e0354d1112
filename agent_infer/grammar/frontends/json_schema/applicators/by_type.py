"""``oneOf`` split by JSON type, for branches that overlap only in some types.

Instances of different JSON types never share a branch's verdict, so ``oneOf [B1..Bn]`` is the
union over the types t of ``oneOf [B1 & t, .., Bn & t]``. Each type is then decided on its own:
no branch or one branch of that type is its own answer; branches of that type proved pairwise
disjoint are an alternation; ``null`` and ``boolean`` are finite, so their values are listed
when exactly one branch accepts them; for the other types the branches are made disjoint with
complements (as for the whole ``oneOf``), else by a check compiled to one automaton
(:mod:`.checks`). A type none of these decide keeps the ``oneOf`` unsupported. Used only where the whole ``oneOf`` has no such lowering, so every grammar that
compiled before is unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_infer.errors import GrammarLimitError, InvalidSchemaError, UnsupportedSchemaError
from agent_infer.grammar.frontends.json_schema.applicators.checks import one_of_check
from agent_infer.grammar.frontends.json_schema.applicators.exclusivity import (
    exclusive_branches,
    pairwise_disjoint,
)
from agent_infer.grammar.frontends.json_schema.values.enums import lower_values
from agent_infer.grammar.frontends.json_schema.values.validation import value_valid
from agent_infer.grammar.ir import Expr, alt

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler

# The JSON types partition the instances ("integer" is a part of "number").
PARTS = ("null", "boolean", "object", "array", "string", "number")
FINITE: dict[str, list[Any]] = {"null": [None], "boolean": [True, False]}


def one_of_by_type(c: Compiler, branches: list[Any], raw: list[Any], pointer: str, depth: int) -> Expr | None:
    """``oneOf`` of the flattened ``branches`` (siblings merged in; ``raw`` without them) as an
    alternation over types, or None when some type stays undecided."""
    parts: list[Expr] = []
    for t in PARTS:
        narrowed: list[Any] = []
        kept_raw: list[Any] = []
        for b, r in zip(branches, raw):
            nb = _narrow(c, b, t, pointer)
            if nb is not False:
                narrowed.append(nb)
                kept_raw.append(r)
        if not narrowed:
            continue
        narrowed, kept_raw, single = _equal_groups(c, narrowed, kept_raw, t)
        if not any(single):
            continue  # every value of this type is in two branches (or none)
        if len(narrowed) == 1 or (all(single) and pairwise_disjoint(c, narrowed)):
            parts.extend(c.lower(b, pointer, depth) for b in narrowed)
            continue
        if t in FINITE:
            try:
                # A group that stood twice holds each of its values twice.
                vals = [
                    v
                    for v in FINITE[t]
                    if sum(
                        (1 if alone else 2) * value_valid(c, b, v, f"{pointer}/oneOf")
                        for b, alone in zip(narrowed, single)
                    )
                    == 1
                ]
            except (UnsupportedSchemaError, GrammarLimitError):
                return None  # a value check this front end cannot run (a recursive schema)
            if vals:
                parts.append(lower_values(c, vals, {}, pointer, depth))
            continue
        if all(single):
            exclusive = exclusive_branches(c, narrowed, kept_raw, pointer)
            if exclusive is not None:
                parts.extend(c.lower(b, pointer, depth) for b in exclusive)
                continue
        checked = one_of_check(c, narrowed, pointer, depth, single)
        if checked is None:
            return None
        parts.append(checked)
    return alt(*parts)


def _equal_groups(
    c: Compiler, narrowed: list[Any], raw: list[Any], t: str
) -> tuple[list[Any], list[Any], list[bool]]:
    """The branches of type ``t`` with equal ones kept once (equal schemas, or any two that every
    value of the type satisfies), and for each whether it stood alone: a value of a group that
    stood twice is in two branches, so only the lone groups can make a value valid."""
    keys: list[Any] = []
    out: list[Any] = []
    out_raw: list[Any] = []
    count: list[int] = []
    for b, r in zip(narrowed, raw):
        key = "universal" if _universal(b, t) else c.schema_keys.key(b)
        if key in keys:
            count[keys.index(key)] += 1
            continue
        keys.append(key)
        out.append(b)
        out_raw.append(r)
        count.append(1)
    return out, out_raw, [n == 1 for n in count]


# Keywords that constrain values of each type (any other keyword leaves them all valid).
_CONSTRAINS = {
    "null": (),
    "boolean": (),
    "string": ("minLength", "maxLength", "pattern", "format", "__not_values", "__not_patterns"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "object": (
        "properties",
        "required",
        "additionalProperties",
        "patternProperties",
        "propertyNames",
        "minProperties",
        "maxProperties",
        "dependentRequired",
        "dependentSchemas",
        "unevaluatedProperties",
        "__some_members",
    ),
    "array": (
        "items",
        "prefixItems",
        "contains",
        "minItems",
        "maxItems",
        "uniqueItems",
        "minContains",
        "maxContains",
        "unevaluatedItems",
    ),
}
_ANY_TYPE = (
    "enum",
    "const",
    "not",
    "anyOf",
    "oneOf",
    "allOf",
    "__conditionals",
    "__not_types",
    "__more_one_of",
)


def _universal(narrowed: Any, t: str) -> bool:
    """Whether every value of type ``t`` satisfies ``narrowed`` (a branch narrowed to ``t``)."""
    if narrowed is True:
        return True
    if not isinstance(narrowed, dict):
        return False
    if any(k in narrowed for k in (*_CONSTRAINS[t], *_ANY_TYPE)):
        return False
    types = narrowed.get("type")
    names = set(types) if isinstance(types, list) else {types}
    return t in names or (t == "number" and "number" in names)


def _narrow(c: Compiler, branch: Any, t: str, pointer: str) -> Any:
    """``branch`` and "of type t" (False when they cannot meet)."""
    try:
        narrowed = c.merge(branch, {"type": ["integer", "number"] if t == "number" else t}, pointer)
    except (UnsupportedSchemaError, InvalidSchemaError, GrammarLimitError):
        return branch if _admits(branch, t) else False
    if narrowed is False or (isinstance(narrowed, dict) and narrowed.get("type") == []):
        return False
    return narrowed


def _admits(branch: Any, t: str) -> bool:
    if not isinstance(branch, dict):
        return bool(branch)
    types = branch.get("type")
    if types is None:
        return True
    names = set(types) if isinstance(types, list) else {types}
    return t in names or (t == "number" and "integer" in names)
