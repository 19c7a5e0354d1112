"""The JSON Schema lowering's :class:`Compiler`: memoized lowering of (sub)schemas to rules,
``$ref``/``allOf`` flattening, the per-type dispatch to the object, array, string and number
lowerings, and the value matchers that decide ``enum``/``const`` values by a schema's own grammar.
Rule naming (:mod:`.rule_writer`), layout (:mod:`.layout`) and the reporting of what it cannot
enforce or ignores (:mod:`.reporting`) are its mixins."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from agent_infer import envs
from agent_infer.errors import GrammarLimitError, InvalidSchemaError, UnsupportedSchemaError
from agent_infer.grammar.automata import DFA, dfa_accepts, expr_to_dfa
from agent_infer.grammar.frontends.json_schema.applicators.alignment import ALIGNED_KEY
from agent_infer.grammar.frontends.json_schema.applicators.canonical_numbers import (
    CANONICAL_KEY,
    lower_canonical_number,
)
from agent_infer.grammar.frontends.json_schema.applicators.checks import all_of_check, lower_aligned
from agent_infer.grammar.frontends.json_schema.applicators.logic import (
    apply_not,
    check_conditionals,
    lower_branches,
    lower_dependencies,
    not_as_check,
    rewrite_logic,
)
from agent_infer.grammar.frontends.json_schema.applicators.merge import Merger
from agent_infer.grammar.frontends.json_schema.keys.key_trie import complement_keys
from agent_infer.grammar.frontends.json_schema.keywords import (
    KNOWN,
    TYPES,
    _lift_conditionals,
    any_unevaluated,
    is_annotation,
    type_set,
    values,
)
from agent_infer.grammar.frontends.json_schema.layout import Layout
from agent_infer.grammar.frontends.json_schema.reporting import Reporter
from agent_infer.grammar.frontends.json_schema.resolve.keyword_checks import schema_text
from agent_infer.grammar.frontends.json_schema.resolve.registry import Registry
from agent_infer.grammar.frontends.json_schema.resolve.schema_keys import SchemaKeys
from agent_infer.grammar.frontends.json_schema.rule_writer import MAX_RULES, RuleWriter
from agent_infer.grammar.frontends.json_schema.types.arrays import lower_array
from agent_infer.grammar.frontends.json_schema.types.numbers import lower_non_integer, lower_number
from agent_infer.grammar.frontends.json_schema.types.objects import lower_object
from agent_infer.grammar.frontends.json_schema.types.patterns import pattern_search
from agent_infer.grammar.frontends.json_schema.types.string_encoding import HIGH_EXPR, HIGH_RULE, JSON_CHAR
from agent_infer.grammar.frontends.json_schema.types.strings import lower_string
from agent_infer.grammar.frontends.json_schema.values.canon import canon, plain_json
from agent_infer.grammar.frontends.json_schema.values.enums import lower_values
from agent_infer.grammar.frontends.json_schema.values.validation import answer_by_type
from agent_infer.grammar.ir import (
    Alt,
    Expr,
    Grammar,
    Ref,
    alt_disjoint,
    lit,
)
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer

MAX_INDENT_DEPTH = 16
MAX_FLATTEN_DEPTH = 64


def _all_of_parts(schema: Any) -> list[Any] | None:
    """The parts of a merge kept apart (``{"__all_of": [...]}``, see :meth:`Compiler.merge`)."""
    if isinstance(schema, dict) and "__all_of" in schema:
        parts: list[Any] = schema["__all_of"]
        return parts
    return None


def _any_value(v: Any) -> bool:
    """The answer of the empty schema's grammar: every JSON value."""
    return True


class Compiler(RuleWriter, Layout, Reporter):
    """Lowers normalized schemas to IR rules; identical subschemas share one rule."""

    def __init__(
        self,
        registry: Registry,
        *,
        strict: bool,
        whitespace: str,
        max_whitespace: int,
        indent: int | None,
        unknown_formats: str = "ignore",
        unknown_keywords: str = "ignore",
        numbers: str = "exact",
    ) -> None:
        self.registry = registry
        self.strict = strict
        self.unknown_formats = unknown_formats
        self.unknown_keywords = unknown_keywords
        self.numbers = numbers  # "exact" or "float64" (types/number_policy.py)
        self.indent = indent
        self.max_seconds = envs.json_schema_max_seconds()
        self.deadline = time.perf_counter() + self.max_seconds
        self.rules: dict[str, Expr] = {}
        self.memo: dict[tuple[int, int], Ref] = {}
        self.schema_keys = SchemaKeys()
        self.warnings: list[str] = []
        self._dfa_cache: dict[str, DFA] = {}
        # (patterns, negated patterns, excluded values, format, minLength, maxLength) -> the rule
        # of their product automaton: schemas repeat one string shape under many properties.
        self.string_products: dict[tuple[Any, ...], Expr] = {}
        self.rules["char"] = JSON_CHAR  # shared: every string body refers to it
        self.rules[HIGH_RULE] = HIGH_EXPR  # shared by encoded classes that include all non-ASCII
        self._blocks: dict[Expr, list[str]] = {}
        self._shared: dict[Expr, str] = {}
        # (sorted declared names, pattern names, pattern mask, propertyNames JSON) -> key expression
        self.key_cache: dict[tuple[Any, ...], Expr | None] = {}
        self.complement_keys = complement_keys(self.rules, MAX_RULES)
        self._matchers: dict[tuple[str, bool], Callable[[Any], bool]] = {}
        # value_matcher keys whose recognizer is being built (a recursive schema would re-enter).
        self._building: set[tuple[str, bool]] = set()
        self._next_suffix: dict[str, int] = {}
        # id(enum list) -> (the list, its canonical values), for values/validation.py
        self.canon_sets: dict[int, tuple[Any, set[Any]]] = {}
        # id(schema with $ref/allOf) -> (the schema, its flattening, the $ref/allOf levels below it)
        self._flat: dict[int, tuple[Any, Any, int]] = {}
        self._flat_deepest = 0  # deepest flatten level reached in the current outermost call
        self.char: Expr = Ref("char")
        self.set_layout(whitespace, max_whitespace)
        # property name -> its quoted key and colon (keys.property_names.quoted_key)
        self.quoted_keys: dict[str, Expr] = {}

    # -- lifetime ------------------------------------------------------------------------------

    def release(self) -> None:
        """Drop everything this (single-use) compiler holds, once its grammar is built or its build
        failed. Its memos hold closures that call back into it (``typed_matcher``), so without
        this the compiler and all it references are a reference cycle: a failed build's rules
        (tens of thousands of IR nodes for a large schema) would wait for a cyclic collection,
        whose traversal then lands on some later request. The matcher memo is shared with the
        sub-compilers of ``_build_matcher`` (whose closures it holds): emptied first, it frees
        them too."""
        matchers = vars(self).get("_matchers")
        if matchers is not None:
            matchers.clear()
        vars(self).clear()

    def lower(self, schema: Any, pointer: str, depth: int) -> Expr:
        """The expression of JSON texts valid under ``schema`` (usually a Ref to a shared rule)."""
        if schema is False or (self.indent is not None and depth > MAX_INDENT_DEPTH):
            # Pinned layouts are depth-specific rules; nesting is capped (documented).
            return Alt(())
        key = (self.schema_keys.key(schema), depth if self.indent is not None else 0)
        ref = self.memo.get(key)
        if ref is None:
            name = self.fresh("any" if schema is True or schema == {} else pointer or "value")
            ref = self.memo[key] = Ref(name)  # IR nodes are immutable: one Ref serves every use
            self.rules[name] = self.lower_body(schema, pointer, depth)
        return ref

    # -- schema flattening ----------------------------------------------------------------------

    def resolve(self, uri: str, pointer: str) -> Any:
        """The schema a ``$ref`` URI points at."""
        return self.registry.resolve(uri, pointer)

    def where(self, schema: Any, fallback: str) -> str:
        """The source pointer of a normalized schema node, if known."""
        return self.registry.pointers.get(id(schema), fallback)

    def flatten(self, schema: Any, pointer: str, level: int = 0) -> Any:
        """Resolve a top-level ``$ref`` and merge ``allOf`` so the result has neither."""
        if isinstance(schema, bool):
            return schema
        if level > MAX_FLATTEN_DEPTH:
            raise GrammarLimitError(f"$ref/allOf nesting deeper than {MAX_FLATTEN_DEPTH} at {pointer or '/'}")
        if not isinstance(schema, dict):
            raise InvalidSchemaError("a schema must be an object or a boolean", pointer=pointer)
        if level > self._flat_deepest:
            self._flat_deepest = level
        if "$ref" not in schema and "allOf" not in schema:
            # Nothing to merge (most schemas): no copy; lowering never mutates the schemas it reads.
            return _lift_conditionals(schema)
        # A definition is flattened again for every subschema that refers to it, and every
        # flattening merges its whole chain of bases: kept per schema object, with the depth it
        # needed so the nesting limit holds wherever it is reused. A flattening that warned is not
        # kept (each place it is met must warn with its own pointer).
        hit = self._flat.get(id(schema))
        if hit is not None and hit[0] is schema and level + hit[2] <= MAX_FLATTEN_DEPTH:
            self._flat_deepest = max(self._flat_deepest, level + hit[2])
            return hit[1]
        outer_deepest, self._flat_deepest = self._flat_deepest, level
        warned = len(self.warnings)
        try:
            out = self._flatten_parts(schema, pointer, level)
        finally:
            height = self._flat_deepest - level
            self._flat_deepest = max(outer_deepest, self._flat_deepest)
        if len(self.warnings) == warned:
            self._flat[id(schema)] = (schema, out, height)
        return out

    def _flatten_parts(self, schema: dict[str, Any], pointer: str, level: int) -> Any:
        """:meth:`flatten` of a schema with ``$ref`` or ``allOf`` (not memoized)."""
        parts: list[Any] = []
        rest = _lift_conditionals({k: v for k, v in schema.items() if k not in ("$ref", "allOf")})
        if "$ref" in schema:
            try:
                target = self.resolve(schema["$ref"], pointer + "/$ref")
            except UnsupportedSchemaError as exc:  # a remote document we were not given
                if self.strict:
                    raise
                self.unsupported("$ref", exc.pointer, str(exc))
                target = True
            parts.append(self.flatten(target, self.where(target, pointer), level + 1))
        for i, sub in enumerate(schema.get("allOf", [])):
            parts.append(self.flatten(sub, f"{pointer}/allOf/{i}", level + 1))
        if parts and any_unevaluated(rest, parts):
            # Which properties count as evaluated depends on the schema structure that merging erases.
            self.unsupported("unevaluatedProperties", pointer, "unevaluated* combined with $ref/allOf")
            parts = [
                {k: v for k, v in p.items() if not k.startswith("unevaluated")} if isinstance(p, dict) else p
                for p in parts
            ]
            rest = {k: v for k, v in rest.items() if not k.startswith("unevaluated")}
        # Referenced/allOf parts first, then the sibling keywords: a base type's properties come
        # before the extension's in the declared order. Siblings that are all annotations (a
        # `$ref` with its own description, most $refs of generated schemas) constrain nothing:
        # the merged parts stand as they are, one shared object for every such reference, so its
        # structural key and lowering are reused too.
        out: Any = parts[0] if parts else rest
        siblings = [rest] if any(not is_annotation(k) for k in rest) else []
        for part in [*parts[1:], *siblings] if parts else []:
            out = self.merge(out, part, pointer)
        return out

    def matches(self, pattern: str, name: str) -> bool:
        """Whether ``name`` contains a match of the ECMA ``pattern`` (exact, via the regex IR)."""
        return dfa_accepts(self.pattern_dfa(pattern, ""), name)

    def pattern_dfa(self, pattern: str, pointer: str) -> DFA:
        """DFA of strings containing a match of ``pattern``; cached per pattern."""
        if pattern not in self._dfa_cache:
            self._dfa_cache[pattern] = expr_to_dfa(self.pattern_expr(pattern, pointer))
        return self._dfa_cache[pattern]

    def pattern_expr(self, pattern: str, pointer: str) -> Expr:
        """The search expression of ``pattern`` (strings containing a match), with a regex's
        errors as the schema errors that name ``pointer``."""
        return pattern_search(pattern, pointer)

    # -- the dispatcher -------------------------------------------------------------------------

    def lower_body(self, schema: Any, pointer: str, depth: int) -> Expr:
        """Lower one schema (not memoized; see :meth:`lower`)."""
        flat = self.flatten(schema, pointer)
        if flat is True:
            flat = {}
        if flat is False:
            return Alt(())
        for key in flat:
            if key not in KNOWN and not is_annotation(key) and not key.startswith("__"):
                self.unknown_keyword(key, f"{pointer}/{key}")
        if "enum" in flat and not isinstance(flat["enum"], list):
            raise InvalidSchemaError("enum must be an array", pointer=f"{pointer}/enum")
        if "__all_of" in flat:
            checked = all_of_check(self, flat["__all_of"], pointer, depth)
            if checked is None:
                raise UnsupportedSchemaError(
                    "allOf cannot be merged exactly, nor decided by a check of its parts",
                    keyword="allOf",
                    pointer=pointer,
                )
            return checked
        if flat.get(ALIGNED_KEY):
            return lower_aligned(self, flat, pointer, depth)
        vals = values(flat)
        if vals is not None:
            # A finite list: every other keyword just filters it, decided exactly per value.
            self.allowed_types(flat, pointer)
            return lower_values(self, vals, flat, pointer, depth, own_enum="const" not in flat)
        if "__more_one_of" in flat and "oneOf" not in flat:
            first, *more = flat["__more_one_of"]
            flat = {k: v for k, v in flat.items() if k != "__more_one_of"} | {"oneOf": first}
            if more:
                flat["__more_one_of"] = more
        if "dependentRequired" in flat or "dependentSchemas" in flat:
            return lower_dependencies(self, flat, pointer, depth)
        if "anyOf" in flat or "oneOf" in flat:
            return lower_branches(self, flat, pointer, depth)
        rewritten = rewrite_logic(self, flat, pointer)
        if rewritten is not None:
            return self.lower_body(rewritten, pointer, depth)
        checked = not_as_check(self, flat, pointer, depth)
        if checked is not None:
            return checked
        flat = apply_not(self, flat, pointer)
        check_conditionals(self, flat, pointer)
        types = self.allowed_types(flat, pointer)
        excluded = {canon(v) for v in flat.get("__not_values", [])}
        out: list[Expr] = []
        for t in types:
            if t == "null":
                out.extend([] if canon(None) in excluded else [lit("null")])
            elif t == "boolean":
                out.extend(lit(json.dumps(b)) for b in (True, False) if canon(b) not in excluded)
            elif t == "object":
                out.append(lower_object(self, flat, pointer, depth))
            elif t == "array":
                out.append(lower_array(self, flat, pointer, depth))
            elif t == "string":
                out.append(lower_string(self, flat, pointer))
            elif t == "number-not-integer":
                out.append(lower_non_integer(self, flat, pointer))
            elif t == "number" and flat.get(CANONICAL_KEY):
                out.append(lower_canonical_number(self, flat, pointer))
            else:
                out.append(lower_number(self, flat, pointer, integer=(t == "integer")))
        # Each type's texts start differently (n, t/f, {, [, ", digit or -): disjoint languages.
        return alt_disjoint(*out) if out else Alt(())

    def allowed_types(self, flat: dict[str, Any], pointer: str) -> list[str]:
        """Types to emit, in a fixed order; "integer" is folded into "number" when both allowed."""
        t = flat.get("type")
        if type(t) is str and t in TYPES and "__not_types" not in flat:
            return [t]  # one valid type: what the general path below gives ("number" alone too)
        if t is not None:
            names = t if isinstance(t, list) else [t]
            for n in names:
                if not isinstance(n, str) or n not in TYPES:
                    raise InvalidSchemaError(f"unknown type {n!r}", pointer=f"{pointer}/type")
        allowed = type_set(flat)
        if allowed is None:
            allowed = set(TYPES)
        for banned in flat.get("__not_types", []):
            allowed.discard(banned)
            if banned == "number":
                allowed.discard("integer")
        if "number" in allowed and "integer" not in allowed:
            allowed.add("number-not-integer")
            allowed.discard("number")
        order = ["null", "boolean", "object", "array", "string", "number", "integer", "number-not-integer"]
        out = [x for x in order if x in allowed]
        if "number" in out and "integer" in out:
            out.remove("integer")
        return out

    def merge(self, a: Any, b: Any, pointer: str) -> Any:
        """``allOf: [a, b]`` merged. Where no keyword-by-keyword merge is exact, strict mode keeps
        both as ``{"__all_of": [a, b]}`` (lowered to a check of both, applicators/checks.py) and
        non-strict mode keeps ``a`` (a superset)."""
        if a is False or b is False:
            return False
        if _all_of_parts(a) is not None or _all_of_parts(b) is not None:
            parts = [p for s in (a, b) for p in (_all_of_parts(s) or [s]) if p is not True and p != {}]
            return {"__all_of": parts}
        try:
            return Merger(self.matches, pointer, self.unknown_format).merge(a, b)
        except UnsupportedSchemaError as exc:
            if self.strict:
                return {"__all_of": [a, b]}
            self.unsupported(exc.keyword, exc.pointer, "allOf cannot be merged exactly")
            return a

    def value_matcher(
        self, schema: Any, pointer: str, *, strict: bool, record: bool = False
    ) -> Callable[[Any], bool]:
        """A predicate "this JSON value is valid under ``schema``", via the schema's own grammar.

        ``record`` copies the sub-compilation's warnings (when its result shapes this grammar).
        """
        key = (schema_text(schema, sort_keys=True), strict)
        if key in self._matchers:
            return self._matchers[key]
        if key in self._building:
            # The values must be checked against a schema that contains this very check (a
            # recursive $ref): building its recognizer would recurse without end.
            raise UnsupportedSchemaError(
                "enum/const values checked against a recursive schema", keyword="enum", pointer=pointer
            )
        self._building.add(key)
        try:
            accepts = self._matchers[key] = self._build_matcher(schema, pointer, strict=strict, record=record)
        finally:
            self._building.discard(key)
        return accepts

    def typed_matcher(
        self, schema: dict[str, Any], unknown: list[str], pointer: str
    ) -> Callable[[Any], bool]:
        """``value_matcher(schema, pointer, strict=self.strict, record=True)`` for a schema of the
        ``unknown`` keywords and at most a ``type``: the same warnings (or error) and answers, where
        a scalar's answer is read off its type (no type: every value) instead of running the
        schema's compiled grammar."""
        key = (schema_text(schema, sort_keys=True), self.strict)
        found = self._matchers.get(key)
        if found is not None:
            return found
        start = len(self.warnings)
        for name in unknown:
            self.unknown_keyword(name, f"{pointer}/{name}")
        # Recorded as value_matcher records a sub-grammar's warnings: each text once.
        new = self.warnings[start:]
        del self.warnings[start:]
        self.warnings.extend(w for w in new if w not in self.warnings)
        if "type" not in schema:
            # Unknown keywords alone: the grammar they leave is any JSON value.
            self._matchers[key] = _any_value
            return _any_value
        typed = {"type": schema["type"]}
        full: list[Callable[[Any], bool]] = []

        def accepts(v: Any) -> bool:
            by_type = answer_by_type(typed, v)
            if by_type is not None:
                return by_type
            if not full:  # containers, or a type name the grammar rejects: the grammar decides
                full.append(self._build_matcher(schema, pointer, strict=self.strict, record=False))
            return full[0](v)

        self._matchers[key] = accepts
        return accepts

    def _build_matcher(
        self, schema: Any, pointer: str, *, strict: bool, record: bool
    ) -> Callable[[Any], bool]:
        """The recognizer behind :meth:`value_matcher` (not memoized)."""
        sub = Compiler(
            self.registry,
            strict=strict,
            whitespace="compact",
            max_whitespace=0,
            indent=None,
            unknown_formats=self.unknown_formats,
            unknown_keywords=self.unknown_keywords,
        )
        sub._dfa_cache = self._dfa_cache
        sub._matchers = self._matchers
        sub._building = self._building
        body = sub.lower(schema, pointer, 0)
        if record:
            self.warnings.extend(w for w in sub.warnings if w not in self.warnings)
        rec = ReferenceRecognizer(Grammar((("root", body), *sub.rules.items()), "root"))

        def accepts(v: Any) -> bool:
            return rec.accepts(plain_json(v))

        return accepts
