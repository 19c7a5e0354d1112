"""The JSON Schema vocabulary of the front end: the keywords it knows (:data:`KNOWN`), the type
names, the annotations (which never affect validity), the keywords whose values are schemas, the
near-miss lookup that tells a typo from an annotation, and the pairing of keywords that qualify each
other (if/then/else, min/maxContains) before ``allOf`` merging."""

from __future__ import annotations

import difflib
import functools
from typing import Any

from agent_infer.grammar.common.memo import register_cache

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


TYPES = ("null", "boolean", "object", "array", "number", "integer", "string")


# Keywords with no effect on validation; dropped silently.
ANNOTATIONS = {
    "title",
    "description",
    "default",
    "examples",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "contentMediaType",
    "contentEncoding",
    "contentSchema",
    "$schema",
    "$id",
    "$anchor",
    "$dynamicAnchor",
    "$vocabulary",
    "$defs",
    "definitions",
    "discriminator",
    "example",
    "externalDocs",
    "xml",
    # editor and generator metadata (VS Code, Snowplow, code generators): never assertions
    "markdownDescription",
    "markdownEnumDescriptions",
    "enumDescriptions",
    "deprecationMessage",
    "errorMessage",
    "defaultSnippets",
    "doNotSuggest",
    "self",
    "readonly",
    "tsType",
    "javaType",
}


def is_annotation(key: str) -> bool:
    """True for keywords that never affect validity (``x-``/``_`` extensions, draft-04 ``id``)."""
    # "_name" is how stripped benchmark schemas and some tools disable a keyword.
    # ("__" marks the compiler's own internal keywords, which are not annotations.)
    return (
        key in ANNOTATIONS
        or key.startswith("x-")
        or (key.startswith("_") and not key.startswith("__"))
        or key == "id"
    )


def type_set(schema: dict[str, Any]) -> set[str] | None:
    """Allowed types ("integer" implied by "number"), or None when unconstrained."""
    t = schema.get("type")
    if t is None:
        return None
    names = set(t) if isinstance(t, list) else {t}
    if "number" in names:
        names.add("integer")
    return names


def values(schema: dict[str, Any]) -> list[Any] | None:
    """The finite value set from const/enum, or None."""
    if "const" in schema:
        return [schema["const"]]
    if "enum" in schema:
        return list(schema["enum"])
    return None


# Keywords whose value is a schema, a map of schemas, or a list of schemas.
SCHEMA_KEYWORDS = {
    "additionalProperties",
    "propertyNames",
    "items",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "unevaluatedProperties",
    "unevaluatedItems",
    "contentSchema",
}


MAP_KEYWORDS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies"}


LIST_KEYWORDS = {"allOf", "anyOf", "oneOf", "prefixItems"}


def any_unevaluated(rest: dict[str, Any], parts: list[Any]) -> bool:
    """Whether ``rest`` or one of ``parts`` has an unevaluated* keyword (a loop, not a generator:
    flatten asks once per $ref/allOf)."""
    for x in (rest, *parts):
        if isinstance(x, dict) and ("unevaluatedProperties" in x or "unevaluatedItems" in x):
            return True
    return False
