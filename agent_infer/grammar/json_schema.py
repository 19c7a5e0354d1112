"""JSON Schema (draft 2020-12, plus draft-07 spellings) to a grammar of exactly the valid JSON texts.

Entry point: :func:`json_schema_to_grammar` (also ``Grammar.from_json_schema``). Policies
(property order, ``format`` as assertion, integers, whitespace, unknown keywords) are documented in
``docs/json_schema.md``. Lowering is split by concern: ``json_schema_resolve`` ($ref/$id),
``json_schema_merge`` (allOf/oneOf), ``json_schema_objects`` (objects/arrays/enum values),
``json_schema_scalars`` (strings/numbers), plus the text, number, format and automata helpers.
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from agent_infer.errors import ConfigError, GrammarLimitError, InvalidSchemaError, UnsupportedSchemaError

# Modules the lowering needs only for some schemas (patterns, enums, `not`, value checks) are
# imported with the front end, not on first use: where no bytecode is cached (e.g. with
# PYTHONDONTWRITEBYTECODE) compiling regex.py alone takes ~10 ms, which would land on whichever
# schema first has a pattern.
from agent_infer.grammar import (  # noqa: F401
    ir_references,
    json_schema_negate,
    json_schema_values,
    reference,
    regex,
)
from agent_infer.grammar import json_schema_logic as logic
from agent_infer.grammar import json_schema_objects as objects
from agent_infer.grammar import json_schema_scalars as scalars
from agent_infer.grammar.caches import register_cache
from agent_infer.grammar.ir import (
    Alt,
    Empty,
    Expr,
    Grammar,
    Ref,
    Repeat,
    alt,
    alt_disjoint,
    chars,
    lit,
    opt,
    seq,
)
from agent_infer.grammar.json_schema_key_trie import complement_keys
from agent_infer.grammar.json_schema_keys import KEY_RULE_PREFIX, SPECIAL_RULE
from agent_infer.grammar.json_schema_memo import SchemaKeys
from agent_infer.grammar.json_schema_merge import (
    TYPES,
    Merger,
    canon,
    is_annotation,
    type_set,
    values,
)
from agent_infer.grammar.json_schema_resolve import Registry, build_registry
from agent_infer.grammar.json_schema_text import HIGH_EXPR, HIGH_RULE, JSON_CHAR

if TYPE_CHECKING:
    from agent_infer.grammar.json_schema_automata import DFA

MAX_RULES = 50_000
MAX_INLINE_REPEAT = 32
# Chunked repeats (Compiler._chunked) up to this many chunks; longer ones use doubling rules.
MAX_CHUNKS = 256
MAX_INDENT_DEPTH = 16
MAX_FLATTEN_DEPTH = 64
# After a newline, flexible whitespace allows this much indentation (json.dumps(indent=2) to depth 20).
MAX_LINE_INDENT = 40

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


def _load(schema: Any) -> Any:
    if isinstance(schema, str):
        try:
            return json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidSchemaError(f"schema is not valid JSON: {exc}", pointer="") from exc
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        return _close_objects(schema.model_json_schema())
    return schema


def _close_objects(node: Any) -> Any:
    """Pydantic drops unknown keys (``extra="ignore"``) or rejects them (``"forbid"``), so generating
    them only wastes tokens: objects that do not say otherwise get ``additionalProperties: false``.
    Models with ``extra="allow"`` state ``additionalProperties: true`` and keep it."""
    if isinstance(node, list):
        return [_close_objects(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {key: _close_objects(value) for key, value in node.items()}
    if "properties" in node and "additionalProperties" not in node:
        out["additionalProperties"] = False
    return out


def json_schema_to_grammar(
    schema: Any,
    *,
    strict: bool = True,
    whitespace: str = "flexible",
    max_whitespace: int = 2,
    indent: int | None = None,
    remotes: Mapping[str, Any] | None = None,
) -> Grammar:
    """Compile a JSON Schema (dict, JSON text, bool, or Pydantic model class) to a Grammar.

    Strict mode raises UnsupportedSchemaError for a keyword that cannot be enforced exactly;
    non-strict mode ignores it and records ``"ignored keyword K at /ptr"`` in ``Grammar.warnings``.
    ``remotes`` maps absolute URIs to schema documents that ``$ref`` may point into.
    """
    if whitespace not in ("flexible", "compact"):
        raise ConfigError(f"whitespace must be 'flexible' or 'compact', got {whitespace!r}")
    if max_whitespace < 0 or (indent is not None and indent < 0):
        raise ConfigError("max_whitespace and indent must be non-negative")
    registry, root = build_registry(_load(schema), remotes)
    comp = Compiler(
        registry, strict=strict, whitespace=whitespace, max_whitespace=max_whitespace, indent=indent
    )
    body = comp.lower(root, "", 0)
    # Rule names come from Compiler.fresh (or fixed valid names) and every Ref names a rule added
    # with it, so the per-node validation walk is skipped (see Grammar.unchecked).
    grammar = Grammar.unchecked((("root", body), *comp.rules.items()), "root", tuple(comp.warnings))
    # Rules named char* ("char", "char-high", "char-special", the key-trie nodes) have bodies that
    # are the same IR objects in every grammar: the serializer caches their programs (compiler.py).
    object.__setattr__(grammar, "_shared_prefix", SHARED_RULE_PREFIX)
    return grammar


_RESERVED = frozenset(("root", "ws", "char", HIGH_RULE, SPECIAL_RULE))
# The body a rule name holds between Compiler.fresh and its real body (the empty language).
_UNBUILT = Alt(())
# Names of the rules whose bodies are process-wide IR objects (only they start with it: fresh names
# come from _rule_base, and a JSON pointer hint never starts with "char").
SHARED_RULE_PREFIX = "char"
_NON_NAME = re.compile(r"[^A-Za-z0-9_-]+")
_NAME_CHARS = re.compile(r"[A-Za-z0-9_-]*")
_RULE_BASE_SCAN = 64


@functools.lru_cache(maxsize=1 << 14)
def _rule_base(hint: str) -> str:
    """The rule-name stem of ``hint``: runs of other characters become ``-``, at most 40 characters."""
    if len(hint) > _RULE_BASE_SCAN:
        # Deep pointers are long and only the last 40 characters are kept: rewrite a tail of the
        # hint. Runs map to one "-" each, so that tail's rewrite is a suffix of the whole one,
        # and once its core (between the outer "-") exceeds 40 characters its last 40 are the
        # whole rewrite's.
        core = _dashes(hint[-_RULE_BASE_SCAN:]).strip("-")
        base = core[-40:] if len(core) > 40 else _dashes(hint).strip("-")[-40:] or "s"
    else:
        base = _dashes(hint).strip("-")[-40:] or "s"
    # The shared key-trie rules own their prefix (json_schema_keys): keep other names out of it.
    return "s-" + base if base.startswith(KEY_RULE_PREFIX) else base


def _dashes(text: str) -> str:
    """``_NON_NAME.sub("-", text)``. Most hints are pointers of name characters, single ``/`` and
    ``.``: two replaces and a match instead of the substitution (~40 % of its cost)."""
    if "//" not in text and ".." not in text and "/." not in text and "./" not in text:
        out = text.replace("/", "-").replace(".", "-")
        if _NAME_CHARS.fullmatch(out):
            return out
    return _NON_NAME.sub("-", text)


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
    if not any(k in schema for k in ("if", "then", "else")):
        return schema
    out = {k: v for k, v in schema.items() if k not in ("if", "then", "else")}
    if "if" in schema and ("then" in schema or "else" in schema):
        out["__conditionals"] = [
            {"if": schema["if"], "then": schema.get("then", True), "else": schema.get("else", True)}
        ]
    return out


class Compiler:
    """Lowers normalized schemas to IR rules; identical subschemas share one rule."""

    def __init__(
        self, registry: Registry, *, strict: bool, whitespace: str, max_whitespace: int, indent: int | None
    ) -> None:
        self.registry = registry
        self.strict = strict
        self.indent = indent
        self.rules: dict[str, Expr] = {}
        self.memo: dict[tuple[int, int], Ref] = {}
        self.schema_keys = SchemaKeys()
        self.warnings: list[str] = []
        self._dfa_cache: dict[str, DFA] = {}
        # (patterns, negated patterns, excluded values, format, minLength, maxLength) -> the rule
        # of their product automaton: schemas repeat one string shape under many properties.
        self.string_products: dict[tuple[Any, ...], Ref] = {}
        self.rules["char"] = JSON_CHAR  # shared: every string body refers to it
        self.rules[HIGH_RULE] = HIGH_EXPR  # shared by encoded classes that include all non-ASCII
        self._blocks: dict[Expr, list[str]] = {}
        self._shared: dict[Expr, str] = {}
        # (sorted declared names, pattern names, pattern mask, propertyNames JSON) -> key expression
        self.key_cache: dict[tuple[Any, ...], Expr | None] = {}
        self.complement_keys = complement_keys(self.rules, MAX_RULES)
        self._matchers: dict[tuple[str, bool], Callable[[Any], bool]] = {}
        self._next_suffix: dict[str, int] = {}
        # id(enum list) -> (the list, its canonical values), for json_schema_values
        self.canon_sets: dict[int, tuple[Any, set[Any]]] = {}
        self.char: Expr = Ref("char")
        blank = chars(" \t")
        if whitespace == "compact" or indent is not None:
            self.ws: Expr = Empty()
        else:
            self.rules["ws"] = alt(
                Repeat(blank, 0, max_whitespace),
                seq(alt(lit("\n"), lit("\r\n")), Repeat(blank, 0, max(MAX_LINE_INDENT, max_whitespace))),
            )
            self.ws = Ref("ws")
        self._colon = lit(": ") if indent is not None else seq(self.ws, lit(":"), self.ws)
        self._seps: dict[int, Expr] = {}
        self._empties: dict[str, Expr] = {}

    # -- reporting -----------------------------------------------------------------------------

    def unsupported(self, keyword: str, pointer: str, why: str) -> None:
        """Strict: raise; non-strict: record a warning and let the caller skip the keyword."""
        if self.strict:
            raise UnsupportedSchemaError(why, keyword=keyword, pointer=pointer)
        self.warnings.append(f"ignored keyword {keyword} at {pointer or '/'}: {why}")

    def unknown_keyword(self, keyword: str, pointer: str) -> None:
        """A keyword from no JSON Schema vocabulary: a likely typo of a real keyword fails closed
        (strict), anything else is an annotation, as validators treat it, noted in the warnings."""
        near = _near_keyword(keyword)
        if near:
            self.unsupported(keyword, pointer, f"unknown keyword {keyword!r} (did you mean {near[0]!r}?)")
        else:
            self.warnings.append(f"ignored unknown keyword {keyword} at {pointer}: treated as an annotation")

    # -- layout --------------------------------------------------------------------------------

    def open(self, depth: int) -> Expr:
        """Whitespace after ``{``/``[`` and after ``,``."""
        return lit("\n" + " " * (self.indent * (depth + 1))) if self.indent is not None else self.ws

    def close(self, depth: int) -> Expr:
        """Whitespace before ``}``/``]``."""
        return lit("\n" + " " * (self.indent * depth)) if self.indent is not None else self.ws

    def sep(self, depth: int) -> Expr:
        """An element separator: optional whitespace, comma, whitespace (or the pinned layout)."""
        # Built once per depth (IR nodes are immutable): every member and element asks for it.
        key = depth if self.indent is not None else 0
        found = self._seps.get(key)
        if found is None:
            found = self._seps[key] = seq(self.ws, lit(","), self.open(depth))
        return found

    def colon(self) -> Expr:
        """The key/value separator."""
        return self._colon

    def container(self, open_: str, close_: str, body: Expr, nullable: bool, depth: int) -> Expr:
        """``open body close`` where ``body`` is non-empty members; the empty form if ``nullable``."""
        full = seq(lit(open_), self.open(depth), body, self.close(depth), lit(close_))
        return alt(full, self.empty(open_, close_)) if nullable else full

    def empty(self, open_: str, close_: str) -> Expr:
        """An empty container: ``{}`` (with optional blank inside in flexible mode)."""
        found = self._empties.get(open_ + close_)
        if found is None:
            found = lit(open_ + close_) if self.indent is not None else seq(lit(open_), self.ws, lit(close_))
            self._empties[open_ + close_] = found
        return found

    # -- rules ---------------------------------------------------------------------------------

    def repeat(self, item: Expr, lo: int, hi: int | None, inline_limit: int = MAX_INLINE_REPEAT) -> Expr:
        """``item{lo,hi}``; counts above ``inline_limit`` use chunks or binary "doubling" rules.

        A limit above MAX_INLINE_REPEAT (string characters) asks for ``inline_limit``-item chunks
        (``_chunked``) when at most MAX_CHUNKS of them are needed.

        Matchers expand counted repeats into automaton states, so ``{0,32767}`` would be 32K
        copies. With ``E_k`` = exactly 2^k items (``E_k ::= E_(k-1) E_(k-1)``) and ``U_k`` = fewer
        than 2^k items (``U_k ::= E_(k-1)? U_(k-1)``), any bound needs O(log n) small rules, and every
        length has exactly one parse (its binary representation).
        """
        if hi == 0:
            return Empty()
        if (hi if hi is not None else lo) <= inline_limit:
            return Repeat(item, lo, hi)
        if inline_limit > MAX_INLINE_REPEAT and hi is not None and lo <= inline_limit:
            if hi - lo < inline_limit:
                return Repeat(item, lo, hi)
            if (hi - lo) // inline_limit <= MAX_CHUNKS:
                return self._chunked(item, lo, hi, inline_limit)
        head = self._exactly(item, lo)
        if hi is None:
            return seq(head, Repeat(item, 0, None))
        return seq(head, self._up_to(item, hi - lo))

    def _chunked(self, item: Expr, lo: int, hi: int, size: int) -> Expr:
        """``item{lo,hi}`` as ``lo`` items, then whole chunks of ``size`` items (one shared rule)
        and a counted tail: every position is a uniform chain position (see grammar_short.cpp),
        and the length after the head, ``a * size + b`` with ``b < size``, has exactly one parse.
        """
        block = self.shared_rule("chunk", Repeat(item, size, size))
        q, r = divmod(hi - lo, size)
        fewer = seq(Repeat(block, 0, q - 1) if q > 1 else Empty(), Repeat(item, 0, size - 1))
        full = seq(Repeat(block, q, q) if q > 1 else block, Repeat(item, 0, r) if r else Empty())
        return seq(Repeat(item, lo, lo) if lo else Empty(), alt(fewer, full))

    def _power(self, item: Expr, k: int) -> Expr:
        """E_k: exactly 2^k copies of ``item`` (a shared rule)."""
        names = self._blocks.setdefault(item, [])
        while len(names) <= k:
            body = item if not names else seq(Ref(names[-1]), Ref(names[-1]))
            names.append(self.add_rule(f"pow{len(names)}", body))
        return Ref(names[k])

    def _exactly(self, item: Expr, n: int) -> Expr:
        return seq(*(self._power(item, k) for k in range(n.bit_length() - 1, -1, -1) if n >> k & 1))

    def _up_to(self, item: Expr, n: int) -> Expr:
        """0..n copies: fewer than 2^k (k = top bit), or 2^k followed by 0..n-2^k."""
        if n == 0:
            return Empty()
        k = n.bit_length() - 1
        below = seq(*(opt(self._power(item, i)) for i in range(k - 1, -1, -1)))
        return alt(below, seq(self._power(item, k), self._up_to(item, n - (1 << k))))

    def shared_rule(self, hint: str, expr: Expr) -> Ref:
        """A reference to one rule per distinct ``expr``, so that equal expressions share states."""
        name = self._shared.get(expr)
        if name is None:
            name = self._shared[expr] = self.add_rule(hint, expr)
        return Ref(name)

    def add_rule(self, hint: str, expr: Expr) -> str:
        """Add a rule with a fresh name derived from ``hint``."""
        name = self.fresh(hint)
        self.rules[name] = expr
        return name

    def fresh(self, hint: str) -> str:
        """A fresh, valid rule name derived from ``hint``."""
        if len(self.rules) >= MAX_RULES:
            raise GrammarLimitError(f"JSON Schema grammar exceeds {MAX_RULES} rules")
        base = _rule_base(hint)
        # Names are only ever added, so every suffix below the one after the last taken for
        # ``base`` is still taken: resume the search there (the smallest free suffix, as a scan
        # from 1 finds).
        k = self._next_suffix.get(base, 1)
        name = base if k == 1 else f"{base}-{k}"
        rules = self.rules
        while name in rules or name in _RESERVED:
            k += 1
            name = f"{base}-{k}"
        self._next_suffix[base] = k + 1
        rules[name] = _UNBUILT  # reserve; replaced when the body is built
        return name

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
        if "$ref" not in schema and "allOf" not in schema:
            # Nothing to merge (most schemas): no copy; lowering never mutates the schemas it reads.
            return _lift_conditionals(schema)
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
        if parts and any(
            isinstance(x, dict) and ("unevaluatedProperties" in x or "unevaluatedItems" in x)
            for x in [rest, *parts]
        ):
            # Which properties count as evaluated depends on the schema structure that merging erases.
            self.unsupported("unevaluatedProperties", pointer, "unevaluated* combined with $ref/allOf")
            parts = [
                {k: v for k, v in p.items() if not k.startswith("unevaluated")} if isinstance(p, dict) else p
                for p in parts
            ]
            rest = {k: v for k, v in rest.items() if not k.startswith("unevaluated")}
        # Referenced/allOf parts first, then the sibling keywords: a base type's properties come
        # before the extension's in the declared order.
        out: Any = parts[0] if parts else rest
        for part in [*parts[1:], rest] if parts else []:
            out = self.merge(out, part, pointer)
        return out

    def matches(self, pattern: str, name: str) -> bool:
        """Whether ``name`` contains a match of the ECMA ``pattern`` (exact, via the regex IR)."""
        from agent_infer.grammar.json_schema_automata import dfa_accepts

        return dfa_accepts(self.pattern_dfa(pattern, ""), name)

    def pattern_dfa(self, pattern: str, pointer: str) -> DFA:
        """DFA of strings containing a match of ``pattern``; cached per pattern."""
        from agent_infer.errors import GrammarSyntaxError, UnsupportedRegexError
        from agent_infer.grammar.json_schema_automata import expr_to_dfa
        from agent_infer.grammar.regex import regex_search_expr

        if pattern not in self._dfa_cache:
            try:
                self._dfa_cache[pattern] = expr_to_dfa(regex_search_expr(pattern, dialect="ecma"))
            except UnsupportedRegexError as exc:
                raise UnsupportedSchemaError(
                    f"pattern {pattern!r}: {exc}", keyword="pattern", pointer=pointer
                ) from exc
            except GrammarSyntaxError as exc:
                raise InvalidSchemaError(
                    f"pattern {pattern!r} is not a valid regex: {exc}", pointer=pointer
                ) from exc
        return self._dfa_cache[pattern]

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
        vals = values(flat)
        if vals is not None:
            # A finite list: every other keyword just filters it, decided exactly per value.
            self.allowed_types(flat, pointer)
            return objects.lower_values(self, vals, flat, pointer, depth)
        if "dependentRequired" in flat or "dependentSchemas" in flat:
            return logic.lower_dependencies(self, flat, pointer, depth)
        if "anyOf" in flat or "oneOf" in flat:
            return logic.lower_branches(self, flat, pointer, depth)
        rewritten = logic.rewrite_logic(self, flat, pointer)
        if rewritten is not None:
            return self.lower_body(rewritten, pointer, depth)
        flat = logic.apply_not(self, flat, pointer)
        logic.check_conditionals(self, flat, pointer)
        types = self.allowed_types(flat, pointer)
        excluded = {canon(v) for v in flat.get("__not_values", [])}
        out: list[Expr] = []
        for t in types:
            if t == "null":
                out.extend([] if canon(None) in excluded else [lit("null")])
            elif t == "boolean":
                out.extend(lit(json.dumps(b)) for b in (True, False) if canon(b) not in excluded)
            elif t == "object":
                out.append(objects.lower_object(self, flat, pointer, depth))
            elif t == "array":
                out.append(objects.lower_array(self, flat, pointer, depth))
            elif t == "string":
                out.append(scalars.lower_string(self, flat, pointer))
            elif t == "number-not-integer":
                out.append(scalars.lower_non_integer(self, flat, pointer))
            else:
                out.append(scalars.lower_number(self, flat, pointer, integer=(t == "integer")))
        # Each type's texts start differently (n, t/f, {, [, ", digit or -): disjoint languages.
        return alt_disjoint(*out) if out else Alt(())

    def allowed_types(self, flat: dict[str, Any], pointer: str) -> list[str]:
        """Types to emit, in a fixed order; "integer" is folded into "number" when both allowed."""
        t = flat.get("type")
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
        """``allOf: [a, b]`` merged; non-strict mode keeps ``a`` (a superset) when no exact merge exists."""
        try:
            return Merger(self.matches, pointer).merge(a, b)
        except UnsupportedSchemaError as exc:
            if self.strict:
                raise
            self.unsupported(exc.keyword, exc.pointer, "allOf cannot be merged exactly")
            return a

    def value_matcher(
        self, schema: Any, pointer: str, *, strict: bool, record: bool = False
    ) -> Callable[[Any], bool]:
        """A predicate "this JSON value is valid under ``schema``", via the schema's own grammar.

        ``record`` copies the sub-compilation's warnings (when its result shapes this grammar).
        """
        from agent_infer.grammar.reference import ReferenceRecognizer

        key = (json.dumps(schema, sort_keys=True, default=str), strict)
        if key in self._matchers:
            return self._matchers[key]
        sub = Compiler(self.registry, strict=strict, whitespace="compact", max_whitespace=0, indent=None)
        sub._dfa_cache = self._dfa_cache
        sub._matchers = self._matchers
        body = sub.lower(schema, pointer, 0)
        if record:
            self.warnings.extend(w for w in sub.warnings if w not in self.warnings)
        rec = ReferenceRecognizer(Grammar((("root", body), *sub.rules.items()), "root"))

        def accepts(v: Any) -> bool:
            return rec.accepts(json.dumps(v, separators=(",", ":"), ensure_ascii=False))

        self._matchers[key] = accepts
        return accepts


register_cache(_rule_base)
register_cache(_near_keyword)
