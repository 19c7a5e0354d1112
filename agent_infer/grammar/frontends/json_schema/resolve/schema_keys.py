"""Structural keys of subschemas, so that the front end translates each distinct one once.

``Compiler.lower`` gives every distinct subschema one rule. Keyed by the schema's full JSON text,
that memo would hold two copies of a subschema apart when only their ``description`` differs, which
is the norm in generated schemas (a Kubernetes ``Normalized`` schema inlines ``ObjectMeta`` and
``LabelSelector`` hundreds of times, each with its own descriptions): about three times the
lowerings, and thousands of equal rules for the native compiler to find and merge. It would also
cost a ``json.dumps`` of the whole subtree at every level (quadratic in the nesting depth).

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

from typing import Any

from agent_infer.grammar.frontends.json_schema.keywords import (
    LIST_KEYWORDS,
    MAP_KEYWORDS,
    SCHEMA_KEYWORDS,
    is_annotation,
)
from agent_infer.grammar.frontends.json_schema.resolve.keyword_checks import schema_text

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
    return schema_text(value)


class SchemaKeys:
    """Interned structural keys of the schema objects met in one compilation."""

    def __init__(self) -> None:
        self._interned: dict[tuple[Any, ...], int] = {}
        # id(schema) -> key; every schema keyed is held in _held, so no other object can have
        # one of these ids while this table lives.
        self._by_id: dict[int, int] = {}
        self._held: list[Any] = []
        self._dropped: dict[str, int] = {}  # keyword name -> _kind(name)

    def key(self, schema: Any) -> int:
        """The key of ``schema``: equal for schemas that lower to the same rule body."""
        if not isinstance(schema, dict):
            return self._intern(("value", _literal(schema)))
        hit = self._by_id.get(id(schema))
        if hit is not None:
            return hit
        parts: list[tuple[str, Any]] = []
        dropped = self._dropped
        for name, value in schema.items():
            kind = dropped.get(name)
            if kind is None:
                kind = dropped[name] = _kind(name)
            if kind == _PLAIN:
                # _literal inline for the common scalar values (most keyword values).
                vt = type(value)
                if vt is str or vt is int or vt is bool or value is None:
                    parts.append((name, (vt, value)))
                else:
                    parts.append((name, _literal(value)))
            elif kind != _DROPPED:
                parts.append((name, self._keyword(kind, value)))
        # Names in a dict are distinct: the pairs sort by name alone, without a key function.
        parts.sort()
        out = self._intern(("schema", *parts))
        self._by_id[id(schema)] = out
        self._held.append(schema)
        return out

    def _keyword(self, kind: int, value: Any) -> Any:
        if kind == _SCHEMA:
            if isinstance(value, list):  # draft-07 tuple "items", if not normalized away
                return ("list", *[self.key(v) for v in value])
            return self.key(value)
        if kind == _MAP and isinstance(value, dict):
            return ("map", *[(k, self.key(v)) for k, v in value.items()])
        if kind == _LIST and isinstance(value, list):
            return ("list", *[self.key(v) for v in value])
        return _literal(value)

    def _intern(self, content: tuple[Any, ...]) -> int:
        found = self._interned.get(content)
        if found is None:
            found = self._interned[content] = len(self._interned)
        return found


# How a keyword's value enters the key (by keyword name, memoized per SchemaKeys).
_DROPPED, _PLAIN, _SCHEMA, _MAP, _LIST = range(5)


def _kind(name: str) -> int:
    if is_annotation(name) and name not in _KEPT_ANNOTATIONS:
        return _DROPPED
    if name in _SCHEMA_VALUED:
        return _SCHEMA
    if name in _SCHEMA_MAPS:
        return _MAP
    if name in _SCHEMA_LISTS:
        return _LIST
    return _PLAIN
