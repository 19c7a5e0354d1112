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
import json
import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

from agent_infer.errors import InvalidSchemaError, UnsupportedSchemaError
from agent_infer.grammar.compile.caches import register_cache

DEFAULT_BASE = "urn:agent-infer:schema"

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
                if key in _SHAPED:
                    _check_shape(key, value, pointer)
                if key in _EXCLUSIVE and isinstance(value, bool):
                    # draft-04: a boolean flag on minimum/maximum
                    bound = "minimum" if key == "exclusiveMinimum" else "maximum"
                    if value and bound in node:
                        out[key] = node[bound]
                        out["__drop_" + bound] = True
                else:
                    out[key] = value
                continue
            here = f"{pointer}/{key}" if "~" not in key and "/" not in key else f"{pointer}/{_escape(key)}"
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
                            dep if isinstance(dep, list) else self._walk(dep, base, f"{here}/{_escape(name)}")
                        )
                        out.setdefault(target, {})[name] = walked
                    continue
                walk = self._walk
                # _escape inline: property names rarely hold "~" or "/".
                out[key] = {
                    k: walk(
                        v, base, f"{here}/{k}" if "~" not in k and "/" not in k else f"{here}/{_escape(k)}"
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
        return node


_COUNTS = {
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
}
_NUMBERS = {"minimum", "maximum", "multipleOf"}
_STRINGS = frozenset(("pattern", "format"))


# Keywords _check_shape looks at, and those _walk rewrites or descends into (the rest are copied).
_SHAPED = frozenset(
    (
        *_COUNTS,
        *_NUMBERS,
        "exclusiveMinimum",
        "exclusiveMaximum",
        "required",
        "enum",
        "const",
        "pattern",
        "format",
        "uniqueItems",
    )
) | {"type"}
_EXCLUSIVE = frozenset(("exclusiveMinimum", "exclusiveMaximum"))
_STRUCTURAL = frozenset(("$ref", "additionalItems", *SCHEMA_KEYWORDS, *MAP_KEYWORDS, *LIST_KEYWORDS))


# Integers are written and compared through their decimal text (grammars, enum filtering), which
# Python refuses to produce past its default int-to-str limit: such integers are rejected, with
# the same bound whatever the interpreter's setting.
MAX_INT_DIGITS = 4300
_INT_BOUND = 10**MAX_INT_DIGITS


class TooLongInteger:
    """An integer literal of JSON schema text with more than MAX_INT_DIGITS digits (``json.loads``
    cannot convert it): kept as its text so the keyword holding it is reported with its pointer."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"<integer of {len(self.text.lstrip('-'))} digits>"

    def __str__(self) -> str:
        return self.text


def schema_text(value: Any, *, sort_keys: bool = False) -> str:
    """``json.dumps(value, default=str)``, the key the compiler's memos use for a schema or a
    value, also where an annotation holds an integer past Python's int-to-str limit (kept by
    validation, which only looks at the keywords that constrain)."""
    try:
        return json.dumps(value, sort_keys=sort_keys, default=str)
    except ValueError:
        return json.dumps(_hex_huge(value), sort_keys=sort_keys, default=str)


def _hex_huge(value: Any) -> Any:
    """``value`` with integers past the int-to-str limit as hex text (hex has no such limit)."""
    kind = type(value)
    if kind is int and not -_INT_BOUND < value < _INT_BOUND:
        return f"<integer 0x{value:x}>"
    if kind is list:
        return [_hex_huge(x) for x in value]
    if kind is dict:
        return {k: _hex_huge(x) for k, x in value.items()}
    return value


def number_problem(v: Any) -> str | None:
    """Why the JSON number ``v`` cannot be compiled (non-finite, too many digits), or None."""
    vt = type(v)
    if vt is float:
        return None if math.isfinite(v) else f"must be a finite number, got {v!r}"
    if vt is TooLongInteger or (vt is not bool and isinstance(v, int) and not -_INT_BOUND < v < _INT_BOUND):
        return f"is an integer with more than {MAX_INT_DIGITS} digits"
    return None


def check_value(value: Any, pointer: str, keyword: str = "enum") -> None:
    """Reject a JSON value (``enum``/``const``) holding a number :func:`number_problem` refuses,
    naming the number's own pointer. Iterative (values nest as deep as their source allows); a
    pointer is spelled out only for a container or the culprit, as enums list thousands of codes."""
    if type(value) in _PLAIN:
        return
    stack = [(value, pointer)]
    while stack:
        v, here = stack.pop()
        vt = type(v)
        if vt is list or vt is dict:
            items = enumerate(v) if vt is list else v.items()
            if vt is list and set(map(type, v)) <= _PLAIN:
                continue
            for k, x in items:
                xt = type(x)
                if xt in _PLAIN:
                    continue
                if xt is list or xt is dict or number_problem(x) is not None:
                    stack.append((x, f"{here}/{_escape(str(k))}"))
        else:
            problem = number_problem(v)
            if problem is not None:
                raise InvalidSchemaError(f"{keyword} value {problem}", pointer=here)


_PLAIN = frozenset((str, bool, type(None)))


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _check_shape(key: str, value: Any, parent: str) -> None:
    """Reject keyword values of the wrong JSON type (InvalidSchemaError with the keyword's pointer,
    under ``parent``, the pointer of the schema holding it)."""
    vt = type(value)
    if vt is str and (key == "type" or key in _STRINGS):
        return  # the common cases, decided without the chain below
    if key == "enum" or key == "const":
        if key == "enum" and not isinstance(value, list):
            raise InvalidSchemaError("enum must be an array", pointer=f"{parent}/enum")
        if vt is not str:
            check_value(value, f"{parent}/{key}", key)
        return
    if (key in _NUMBERS or key in _EXCLUSIVE or key in _COUNTS) and vt is not bool:
        # Non-finite and over-long numbers first: the checks below would convert them.
        problem = number_problem(value)
        if problem is not None:
            raise InvalidSchemaError(f"{key} {problem}", pointer=f"{parent}/{_escape(key)}")
    is_num = _is_num
    problem = None
    if key in _COUNTS and not (is_num(value) and value >= 0 and value == int(value)):
        problem = "must be a non-negative integer"
    elif key in _NUMBERS and not is_num(value):
        problem = "must be a number"
    elif key == "multipleOf" and value <= 0:
        problem = "must be greater than 0"
    elif key in ("exclusiveMinimum", "exclusiveMaximum") and not (is_num(value) or isinstance(value, bool)):
        problem = "must be a number"
    elif key == "required" and not (isinstance(value, list) and all(isinstance(r, str) for r in value)):
        problem = "must be an array of strings"
    elif key in ("pattern", "format") and not isinstance(value, str):
        problem = "must be a string"
    elif key == "uniqueItems" and not isinstance(value, bool):
        problem = "must be a boolean"
    elif key == "type" and not (
        isinstance(value, str) or (isinstance(value, list) and all(isinstance(t, str) for t in value))
    ):
        problem = "must be a string or an array of strings"
    if problem:
        raise InvalidSchemaError(f"{key} {problem}", pointer=f"{parent}/{_escape(key)}")


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def build_registry(schema: Any, remotes: Mapping[str, Any] | None) -> tuple[Registry, Any]:
    """Register the root document (and any ``remotes``) and return the normalized root."""
    reg = Registry()
    for uri, doc in (remotes or {}).items():
        reg.add_document(doc, uri)
    root_base = DEFAULT_BASE
    root = reg.add_document(schema, root_base)
    reg.resources.setdefault(root_base, root)
    return reg, root


register_cache(_defrag)
register_cache(_defrag_doc)
register_cache(_join)
