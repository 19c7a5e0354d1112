"""The JSON Schema keyword vocabulary the front end knows (:data:`KNOWN`), the near-miss lookup
that tells a typo from an annotation, and the pairing of keywords that qualify each other
(if/then/else, min/maxContains) before ``allOf`` merging."""

from __future__ import annotations

import difflib
import functools
from typing import Any

from agent_infer.grammar.compile.caches import register_cache

KNOWN = {
    "type",
    "enum",
    "const",
    "$ref",
    "allOf",
    "anyOf",
    "oneOf",
    "not",
    "if",
    "then",
    "else",
    "properties",
    "patternProperties",
    "additionalProperties",
    "required",
    "propertyNames",
    "minProperties",
    "maxProperties",
    "dependentRequired",
    "dependentSchemas",
    "unevaluatedProperties",
    "items",
    "prefixItems",
    "minItems",
    "maxItems",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "unevaluatedItems",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "$dynamicRef",
    "$recursiveRef",
    "$recursiveAnchor",
}


_KNOWN_SORTED = sorted(KNOWN)


@functools.lru_cache(maxsize=4096)
def _near_keyword(keyword: str) -> list[str]:
    """The known keyword ``keyword`` is likely a typo of (at most one; a pure function of it)."""
    # A similarity ratio is at most 2 * min(len) / (sum of lengths): candidates whose lengths
    # alone keep them under the cutoff could never be returned, so difflib is spared them.
    n = len(keyword)
    near = [k for k in _KNOWN_SORTED if 2 * min(n, len(k)) >= 0.8 * (n + len(k))]
    return difflib.get_close_matches(keyword, near, n=1, cutoff=0.8) if near else []


def _lift_conditionals(schema: dict[str, Any]) -> dict[str, Any]:
    """Keep keywords that qualify each other paired before merging (allOf) mixes schema objects.

    if/then/else move into ``__conditionals`` (a lone ``then``/``else`` or ``if`` has no effect and
    is dropped); ``minContains``/``maxContains`` without a sibling ``contains`` are dropped."""
    if "contains" not in schema and ("minContains" in schema or "maxContains" in schema):
        # min/maxContains only qualify a `contains` in the same schema object
        schema = {k: v for k, v in schema.items() if k not in ("minContains", "maxContains")}
    if "if" not in schema and "then" not in schema and "else" not in schema:
        return schema
    out = {k: v for k, v in schema.items() if k not in ("if", "then", "else")}
    if "if" in schema and ("then" in schema or "else" in schema):
        out["__conditionals"] = [
            {"if": schema["if"], "then": schema.get("then", True), "else": schema.get("else", True)}
        ]
    return out


register_cache(_near_keyword)
