"""Structural keys of subschemas, so that the front end translates each distinct one once.

``Compiler.lower`` gives every distinct subschema one rule. Keying that memo by the schema's full
JSON text made two copies of a subschema distinct when only their ``description`` differed, which
is the norm in generated schemas (a Kubernetes ``Normalized`` schema inlines ``ObjectMeta`` and
``LabelSelector`` hundreds of times, each with its own descriptions): 468 lowerings instead of 147,
and thousands of equal rules that the native compiler then had to find and merge. It also cost a
``json.dumps`` of the whole subtree at every level (quadratic in the nesting depth).

A key here is a small int, computed bottom-up once per schema object (by identity, the object
kept alive so its id stays unique) and interned by content:

* annotation keywords (``is_annotation``: ``description``, ``title``, ``examples``, ``x-*``...)
  are left out, except those that can change how ``$ref`` resolves or which dialect applies;
* keyword order is irrelevant, but the order of ``properties`` (the member order of the grammar)
  and of every JSON value (``enum``, ``const``, ``required``...) is kept: values are compared
  exactly (by type and value, or by JSON text), so ``1`` and ``1.0`` stay distinct, as do
  differently ordered objects;
* subschemas (under ``items``, ``properties``, ``anyOf``...) contribute their own keys, so equal
  copies of a deep subtree cost one walk each and one interned key.

Schema objects must not be mutated while a compilation holds keys for them (the front end
builds every schema dict completely before lowering it).
"""

from __future__ import annotations

import json
from typing import Any

from agent_infer.grammar.json_schema_merge import is_annotation
from agent_infer.grammar.json_schema_resolve import LIST_KEYWORDS, MAP_KEYWORDS, SCHEMA_KEYWORDS

# Annotations that still matter for the translation: they set a base URI or an anchor that $ref
# and $dynamicRef resolve against, or they name the dialect.
_KEPT_ANNOTATIONS = frozenset(
    (
        "$id",
        "id",
        "$anchor",
        "$dynamicAnchor",
        "$recursiveAnchor",
        "$schema",
        "$vocabulary",
        "$defs",
        "definitions",
    )
)
_SCHEMA_VALUED = frozenset(SCHEMA_KEYWORDS | {"additionalItems"})
_SCHEMA_MAPS = frozenset(MAP_KEYWORDS - {"dependencies"})  # dependencies mixes arrays and schemas
_SCHEMA_LISTS = frozenset(LIST_KEYWORDS)


def _literal(value: Any) -> object:
    """A value compared exactly: tagged by type (``1``, ``1.0`` and ``true`` differ), floats by
    their spelling, anything else by its JSON text (key order kept: it can matter for enum objects)."""
    kind = type(value)
    if kind is str or kind is int or kind is bool or value is None:
        return (kind, value)
    if kind is float:
        return (kind, repr(value))
    if kind is list and all(type(x) is str for x in value):
        return (kind, *value)
    return json.dumps(value, default=str)


class SchemaKeys:
    """Interned structural keys of the schema objects met in one compilation."""

    def __init__(self) -> None:
        self._interned: dict[tuple[Any, ...], int] = {}
        # id(schema) -> (schema, key): the schema is held so that its id is not reused.
        self._by_id: dict[int, tuple[Any, int]] = {}
        self._dropped: dict[str, bool] = {}

    def key(self, schema: Any) -> int:
        """The key of ``schema``: equal for schemas that lower to the same rule body."""
        if not isinstance(schema, dict):
            return self._intern(("value", _literal(schema)))
        hit = self._by_id.get(id(schema))
        if hit is not None and hit[0] is schema:
            return hit[1]
        parts: list[tuple[str, Any]] = []
        dropped = self._dropped
        for name, value in schema.items():
            drop = dropped.get(name)
            if drop is None:
                drop = dropped[name] = is_annotation(name) and name not in _KEPT_ANNOTATIONS
            if drop:
                continue
            parts.append((name, self._keyword(name, value)))
        parts.sort(key=_first)
        out = self._intern(("schema", *parts))
        self._by_id[id(schema)] = (schema, out)
        return out

    def _keyword(self, name: str, value: Any) -> Any:
        if name in _SCHEMA_VALUED:
            if isinstance(value, list):  # draft-07 tuple "items", if not normalized away
                return ("list", *[self.key(v) for v in value])
            return self.key(value)
        if name in _SCHEMA_MAPS and isinstance(value, dict):
            return ("map", *[(k, self.key(v)) for k, v in value.items()])
        if name in _SCHEMA_LISTS and isinstance(value, list):
            return ("list", *[self.key(v) for v in value])
        return _literal(value)

    def _intern(self, content: tuple[Any, ...]) -> int:
        found = self._interned.get(content)
        if found is None:
            found = self._interned[content] = len(self._interned)
        return found


def _first(part: tuple[str, Any]) -> str:
    return part[0]
