"""Intersection of JSON Schemas (``allOf``).

``allOf`` cannot be lowered by concatenation or alternation: a CFG has no intersection. Instead the
subschemas are merged keyword by keyword into one schema whose instances are exactly those valid
under all of them. Where a keyword pair has no exact merge (two different formats, two ``contains``,
``additionalProperties`` interacting with foreign ``patternProperties``), UnsupportedSchemaError.
Nested schemas are merged lazily as ``{"allOf": [x, y]}`` and flattened when they are lowered.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from agent_infer.errors import UnsupportedSchemaError
from agent_infer.grammar.common.memo import register_cache
from agent_infer.grammar.frontends.json_schema.keywords import KNOWN, is_annotation, type_set, values
from agent_infer.grammar.frontends.json_schema.types.formats import is_unknown_format
from agent_infer.grammar.frontends.json_schema.values.canon import canon, to_fraction

_MIN = {"minLength", "minItems", "minProperties", "minimum", "exclusiveMinimum", "minContains"}
_MAX = {"maxLength", "maxItems", "maxProperties", "maximum", "exclusiveMaximum", "maxContains"}
_OBJECT = ("properties", "patternProperties", "additionalProperties")
_ARRAY = ("prefixItems", "items")


# key -> is_annotation(key), for the hot loops (keyword names repeat within a schema); emptied
# with the other front-end memos (clear_grammar_caches).
_ANNOTATION_MEMO: dict[str, bool] = {}
register_cache(_ANNOTATION_MEMO)


def _annotation(key: str) -> bool:
    """is_annotation(key), remembered in _ANNOTATION_MEMO (bounded: keys come from schemas)."""
    found = is_annotation(key)
    if len(_ANNOTATION_MEMO) < 4096:
        _ANNOTATION_MEMO[key] = found
    return found


def _both(a: Any, b: Any) -> Any:
    if a is True or a == {}:
        return b
    if b is True or b == {}:
        return a
    if a is False or b is False:
        return False
    return {"allOf": [a, b]}


def _lcm(a: Fraction, b: Fraction) -> Fraction:
    num = a.numerator * b.numerator // math.gcd(a.numerator, b.numerator)
    return Fraction(num, math.gcd(a.denominator, b.denominator))


class Merger:
    """Merges flattened schemas; ``matches(pattern, name)`` tells if a key matches a pattern."""

    def __init__(
        self, matches: Callable[[str, str], bool], pointer: str, unknown_format: Callable[[str, str], None]
    ) -> None:
        self.matches = matches
        self.pointer = pointer
        # Reports a format the merge drops as an annotation (the Compiler's warning or error).
        self.unknown_format = unknown_format

    def fail(self, keyword: str, why: str) -> UnsupportedSchemaError:
        return UnsupportedSchemaError(
            f"allOf cannot be merged exactly: {why}", keyword=keyword, pointer=self.pointer
        )

    def _for_key(self, s: dict[str, Any], name: str) -> Any:
        if name in s.get("properties", {}):
            return s["properties"][name]
        hits = [v for p, v in s.get("patternProperties", {}).items() if self.matches(p, name)]
        if hits:
            out: Any = True
            for h in hits:
                out = _both(out, h)
            return out
        return s.get("additionalProperties", True)

    def merge(self, a: Any, b: Any) -> Any:
        """A schema equivalent to ``allOf: [a, b]`` for flattened (no top-level $ref/allOf) a and b."""
        if a is False or b is False:
            return False
        if a is True:
            return b
        if b is True:
            return a
        # is_annotation per key through its memo, and the keyword tests spelled out (no generator
        # per test): a Kubernetes schema merges ~100 $ref siblings, ~5 % of its front end.
        known = _ANNOTATION_MEMO
        out = {k: v for k, v in a.items() if not (known[k] if k in known else _annotation(k))}
        if (
            "properties" in a
            or "patternProperties" in a
            or "additionalProperties" in a
            or "properties" in b
            or "patternProperties" in b
            or "additionalProperties" in b
        ):
            self._merge_objects(a, b, out)
        if "prefixItems" in a or "items" in a or "prefixItems" in b or "items" in b:
            # items applies after the *sibling* prefixItems only, so merge the pair jointly.
            pa, pb = a.get("prefixItems", []), b.get("prefixItems", [])
            ia, ib = a.get("items", True), b.get("items", True)
            n = max(len(pa), len(pb))
            out.pop("prefixItems", None)
            if n:
                out["prefixItems"] = [
                    _both(pa[i] if i < len(pa) else ia, pb[i] if i < len(pb) else ib) for i in range(n)
                ]
            items = _both(ia, ib)
            if items is not True:
                out["items"] = items
            else:
                out.pop("items", None)
        if "oneOf" in a and "oneOf" in b and a["oneOf"] != b["oneOf"]:
            # Two oneOfs are two separate assertions: the second waits in __more_one_of and is
            # lowered inside each branch of the first (compiler.lower_body).
            out["__more_one_of"] = [*out.get("__more_one_of", []), b["oneOf"]]
            b = {k: v for k, v in b.items() if k != "oneOf"}
        va, vb_ = values(a), values(b)
        if va is not None and vb_ is not None:
            keep = {canon(v) for v in vb_}
            out.pop("const", None)
            out["enum"] = [v for v in va if canon(v) in keep]
        for key, vb in b.items():
            if (
                is_annotation(key)
                or key in _OBJECT
                or key in _ARRAY
                or (va is not None and vb_ is not None and key in ("enum", "const"))
            ):
                continue
            if key not in out:
                out[key] = vb
                continue
            out[key] = self._merge_key(key, out[key], vb, a, b)
        return out

    def _merge_objects(self, a: dict[str, Any], b: dict[str, Any], out: dict[str, Any]) -> None:
        names = list(a.get("properties", {}))
        names += [n for n in b.get("properties", {}) if n not in names]
        if (
            names
            and not b.get("properties")
            and not b.get("patternProperties")
            and b.get("additionalProperties", True) is True
        ):
            # b constrains no member (a $ref's sibling annotations, most often): each property
            # keeps a's schema, as _both(a's, True) gives it, without the per-name lookups.
            out["properties"] = {n: True if v is True or v == {} else v for n, v in a["properties"].items()}
            names = []
        if names:
            out["properties"] = {n: _both(self._for_key(a, n), self._for_key(b, n)) for n in names}
        pa, pb = a.get("patternProperties", {}), b.get("patternProperties", {})
        adda, addb = a.get("additionalProperties", True), b.get("additionalProperties", True)
        trivial: tuple[Any, ...] = (True, {})
        out.pop("patternProperties", None)
        out.pop("additionalProperties", None)
        if not pa and not pb:
            add = _both(adda, addb)
            if add is not True:
                out["additionalProperties"] = add
        elif adda in trivial and addb in trivial:
            merged = dict(pa)
            for p, v in pb.items():
                merged[p] = _both(merged[p], v) if p in merged else v
            out["patternProperties"] = merged
        elif not pb:
            # b's additionalProperties covers every key b does not declare, matched by a's
            # patterns or not: it joins each of a's pattern schemas and a's additionalProperties.
            out["patternProperties"] = {p: _both(v, addb) for p, v in pa.items()}
            add = _both(adda, addb)
            if add is not True:
                out["additionalProperties"] = add
        elif not pa:
            out["patternProperties"] = {p: _both(adda, v) for p, v in pb.items()}
            add = _both(adda, addb)
            if add is not True:
                out["additionalProperties"] = add
        else:
            raise self.fail(
                "patternProperties", "patternProperties next to another branch's additionalProperties"
            )

    def _merge_key(self, key: str, va: Any, vb: Any, a: dict[str, Any], b: dict[str, Any]) -> Any:
        if va == vb and key != "anyOf":
            return va
        if key.startswith("__not_") or key in ("__conditionals", "__some_members", "__more_one_of"):
            return [*va, *vb]
        if key == "type":
            ta, tb = type_set(a) or set(), type_set(b) or set()
            both = ta & tb
            return sorted(both) if len(both) != 1 else next(iter(both))
        if key == "required":
            return list(dict.fromkeys([*va, *vb]))
        if key in _MIN:
            return max(va, vb, key=lambda x: to_fraction(x) if isinstance(x, int | float) else x)
        if key in _MAX:
            return min(va, vb, key=lambda x: to_fraction(x) if isinstance(x, int | float) else x)
        if key == "multipleOf":
            lcm = _lcm(to_fraction(va), to_fraction(vb))
            return int(lcm) if lcm.denominator == 1 else float(lcm)
        if key == "pattern":
            return {"__patterns": [*_patterns(va), *_patterns(vb)]}
        if key in ("propertyNames", "contentSchema"):
            return _both(va, vb)
        if key == "not":
            return {"anyOf": [va, vb]}
        if key == "anyOf":
            if len(va) * len(vb) > 64:
                raise self.fail("anyOf", "too many anyOf combinations")
            return [_both(x, y) for x in va for y in vb]
        if key == "uniqueItems":
            return bool(va or vb)
        if key == "dependentRequired":
            return {k: list(dict.fromkeys([*va.get(k, []), *vb.get(k, [])])) for k in {**va, **vb}}
        if key == "dependentSchemas":
            return {k: _both(va.get(k, True), vb.get(k, True)) for k in {**va, **vb}}
        if key == "format" and (is_unknown_format(va) or is_unknown_format(vb)):
            # An unknown format constrains nothing: the other one is the merge.
            dropped, kept = (vb, va) if is_unknown_format(vb) else (va, vb)
            self.unknown_format(dropped, f"{self.pointer}/format")
            return kept
        if key not in KNOWN and not key.startswith("__"):
            # Two values of an unknown keyword: an annotation either way, reported where the merged
            # schema is lowered.
            return va
        raise self.fail(key, f"two different {key!r} values")


def _patterns(v: Any) -> list[str]:
    return list(v["__patterns"]) if isinstance(v, dict) else [v]


def all_of(*schemas: Any) -> Any:
    real = [s for s in schemas if s is not True and s != {}]
    if not real:
        return True
    return real[0] if len(real) == 1 else {"allOf": real}
