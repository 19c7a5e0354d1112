"""Schema documents, ``$id``/``$anchor`` registries and ``$ref`` resolution for the JSON Schema compiler.

Each document is copied once with every ``$ref`` rewritten to an absolute URI, so afterwards any
subschema can be lowered or merged (``allOf``) without knowing the base URI it came from. Draft-07
spellings are normalized here too: array-form ``items`` + ``additionalItems`` become
``prefixItems`` + ``items``, ``definitions`` stays addressable, ``dependencies`` splits into
``dependentRequired``/``dependentSchemas``, and draft-04 boolean ``exclusiveMinimum``/``Maximum``
become numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

from agent_infer.errors import InvalidSchemaError, UnsupportedSchemaError
from agent_infer.grammar.common.memo import register_cache
from agent_infer.grammar.frontends.json_schema.keywords import LIST_KEYWORDS, MAP_KEYWORDS, SCHEMA_KEYWORDS
from agent_infer.grammar.frontends.json_schema.resolve.keyword_checks import (
    EXCLUSIVE_KEYWORDS,
    SHAPED_KEYWORDS,
    check_shape,
    pointer_escape,
)

DEFAULT_BASE = "urn:agent-infer:schema"


@functools.lru_cache(maxsize=1 << 14)
def _defrag(uri: str) -> tuple[str, str]:
    """``urldefrag(uri)`` as a plain pair (cached: generated schemas repeat their $ref URIs)."""
    if "#" not in uri:
        return uri, ""  # what urldefrag returns without parsing
    doc, _, frag = uri.partition("#")
    if "\t" in frag or "\r" in frag or "\n" in frag:
        doc, frag = urldefrag(uri)  # urlsplit deletes these from the fragment too
        return doc, frag
    # urlsplit cuts the fragment off at the first "#" before it parses the rest, so the document
    # part depends on ``doc`` alone: parsed once per document instead of once per pointer into it
    # (a Kubernetes schema has hundreds of distinct #/definitions/... URIs, all in one document).
    return _defrag_doc(doc), frag


@functools.lru_cache(maxsize=1 << 10)
def _defrag_doc(doc: str) -> str:
    """``urldefrag(doc + "#...")[0]``: the document URI as urlparse/urlunparse rewrite it."""
    return urldefrag(doc + "#")[0]


@functools.lru_cache(maxsize=1 << 14)
def _join(base: str, ref: str) -> str:
    # urljoin does not understand "urn:" bases; fragments and full URIs still work on them.
    if ref.startswith("#"):
        return _defrag(base)[0] + ref
    if base.startswith("urn:") and ":" not in ref.split("/")[0]:
        return base.rsplit("/", 1)[0] + "/" + ref if "/" in base else ref
    return urljoin(base, ref)


class Registry:
    """Resources by absolute URI, anchors, and JSON-pointer resolution into them."""

    def __init__(self) -> None:
        # Whether a schema's plain ``id`` is its identifier (drafts 3 and 4, before ``$id``).
        self.legacy_id = False
        self.resources: dict[str, Any] = {}
        self.anchors: dict[str, Any] = {}
        self.pointers: dict[int, str] = {}  # id(normalized node) -> pointer, for error messages
        # uri -> resolved node: generated schemas $ref the same definitions hundreds of times, and
        # splitting the URI (urldefrag) costs more than the lookup (documents are not changed
        # once registered; failures are not kept, so each raises with its own pointer).
        self._resolved: dict[str, Any] = {}

    def add_document(self, schema: Any, uri: str) -> Any:
        """Normalize and register a document; return its normalized root."""
        return self._walk(schema, uri, "")

    def _walk(self, node: Any, base: str, pointer: str) -> Any:
        if isinstance(node, bool):
            return node
        if not isinstance(node, dict):
            raise InvalidSchemaError(
                f"a schema must be an object or a boolean, got {type(node).__name__}", pointer=pointer
            )
        out: dict[str, Any] = {}
        ident = node.get("$id")
        if ident is None and self.legacy_id:
            ident = node.get("id")
        if isinstance(ident, str):
            frag_less, frag = _defrag(_join(base, ident))
            if frag_less:
                base = frag_less
            if frag:  # draft-07 "$id": "#name" is an anchor
                self.anchors[f"{base}#{frag}"] = out
        if isinstance(ident, str) or pointer == "":
            self.resources.setdefault(base, out)
        if isinstance(node.get("$anchor"), str):
            self.anchors[f"{base}#{node['$anchor']}"] = out
        for key, value in node.items():
            if key not in _STRUCTURAL:
                # Most keywords are plain values: their pointer is only spelled out for an error.
                if key in SHAPED_KEYWORDS:
                    check_shape(key, value, pointer)
                if key in EXCLUSIVE_KEYWORDS and isinstance(value, bool):
                    # draft-04: a boolean flag on minimum/maximum
                    bound = "minimum" if key == "exclusiveMinimum" else "maximum"
                    if value and bound in node:
                        out[key] = node[bound]
                        out["__drop_" + bound] = True
                else:
                    out[key] = value
                continue
            here = (
                f"{pointer}/{key}"
                if "~" not in key and "/" not in key
                else f"{pointer}/{pointer_escape(key)}"
            )
            if key == "$ref":
                if not isinstance(value, str):
                    raise InvalidSchemaError("$ref must be a string", pointer=here)
                out[key] = _join(base, value)
            elif key in SCHEMA_KEYWORDS and key != "items":
                out[key] = self._walk(value, base, here)
            elif key == "items":
                if isinstance(value, list):  # draft-07 tuple form
                    out["prefixItems"] = [self._walk(v, base, f"{here}/{i}") for i, v in enumerate(value)]
                    if "additionalItems" in node:
                        out["items"] = self._walk(node["additionalItems"], base, f"{pointer}/additionalItems")
                else:
                    out[key] = self._walk(value, base, here)
            elif key == "additionalItems":
                continue  # only meaningful next to array-form items (handled there)
            elif key in MAP_KEYWORDS:
                if not isinstance(value, dict):
                    raise InvalidSchemaError(f"{key} must be an object", pointer=here)
                if key == "dependencies":
                    for name, dep in value.items():
                        target = "dependentRequired" if isinstance(dep, list) else "dependentSchemas"
                        walked = (
                            dep
                            if isinstance(dep, list)
                            else self._walk(dep, base, f"{here}/{pointer_escape(name)}")
                        )
                        out.setdefault(target, {})[name] = walked
                    continue
                walk = self._walk
                # pointer_escape inline: property names rarely hold "~" or "/".
                out[key] = {
                    k: walk(
                        v,
                        base,
                        f"{here}/{k}" if "~" not in k and "/" not in k else f"{here}/{pointer_escape(k)}",
                    )
                    for k, v in value.items()
                }
            elif key in LIST_KEYWORDS:
                if not isinstance(value, list) or (key != "prefixItems" and not value):
                    raise InvalidSchemaError(f"{key} must be a non-empty array", pointer=here)
                out[key] = [self._walk(v, base, f"{here}/{i}") for i, v in enumerate(value)]
        if "__drop_minimum" in out or "__drop_maximum" in out:
            for bound in ("minimum", "maximum"):
                if out.pop("__drop_" + bound, False):
                    out.pop(bound, None)
        self.pointers[id(out)] = pointer
        return out

    def resolve(self, uri: str, pointer: str) -> Any:
        """The normalized schema ``uri`` points at; dangling → InvalidSchemaError, remote → Unsupported."""
        if uri in self._resolved:
            return self._resolved[uri]
        found = self._resolve(uri, pointer)
        self._resolved[uri] = found
        return found

    def _resolve(self, uri: str, pointer: str) -> Any:
        doc_uri, frag = _defrag(uri)
        if uri in self.anchors:
            return self.anchors[uri]
        doc = self.resources.get(doc_uri)
        if doc is None:
            if doc_uri.startswith(("http://", "https://")) and not doc_uri.startswith(DEFAULT_BASE):
                raise UnsupportedSchemaError(
                    f"remote reference {uri!r} is not in `remotes`", keyword="$ref", pointer=pointer
                )
            raise InvalidSchemaError(f"$ref {uri!r} does not resolve", pointer=pointer)
        if not frag:
            return doc
        if not frag.startswith("/"):
            raise InvalidSchemaError(f"$ref anchor {frag!r} is not defined", pointer=pointer)
        node: Any = doc
        for part in frag.split("/")[1:]:
            part = unquote(part).replace("~1", "/").replace("~0", "~")
            if isinstance(node, dict) and part in node:
                node = node[part]
            elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict) and part == "items" and "prefixItems" in node:
                node = node["prefixItems"]  # draft-07 tuple items were renamed
            else:
                raise InvalidSchemaError(f"$ref {uri!r} does not resolve", pointer=pointer)
        if isinstance(node, dict) and id(node) not in self.pointers:
            # A schema inside a keyword this front end does not read (``links``, a document-level
            # ``defs``): normalized where a reference reaches it, as validators resolve it.
            node = self._walk(node, doc_uri, frag)
        return node


_STRUCTURAL = frozenset(("$ref", "additionalItems", *SCHEMA_KEYWORDS, *MAP_KEYWORDS, *LIST_KEYWORDS))


def build_registry(schema: Any, remotes: Mapping[str, Any] | None) -> tuple[Registry, Any]:
    """Register the root document (and any ``remotes``) and return the normalized root."""
    reg = Registry()
    for uri, doc in (remotes or {}).items():
        reg.add_document(doc, uri)
    draft = schema.get("$schema") if isinstance(schema, dict) else None
    reg.legacy_id = isinstance(draft, str) and any(f"draft-0{n}/" in draft for n in (3, 4))
    root_base = DEFAULT_BASE
    root = reg.add_document(schema, root_base)
    reg.resources.setdefault(root_base, root)
    return reg, root


register_cache(_defrag)
register_cache(_defrag_doc)
register_cache(_join)
