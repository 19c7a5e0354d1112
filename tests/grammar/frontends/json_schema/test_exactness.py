"""JSON Schema front end exactness: grammars of schemas that combine keywords, against jsonschema.

Many small generated schemas combine keywords lowered by separate code paths (``required`` with
property counts, ``enum``/``const`` with siblings, item counts with ``prefixItems``/``contains``,
lengths with patterns/formats, bounds with ``multipleOf``, logic keywords around them). Each is
compiled strictly and run with the native matcher on the bytes-only vocabulary over enumerated
candidate instances: no accepted instance may be invalid, and a rejected valid one must be a
documented false negative (member order, ``3.0`` for an integer).
"""

from __future__ import annotations

import itertools
import json
import random
from decimal import Decimal
from typing import Any

import jsonschema
import pytest

from agent_infer.errors import GrammarDefinitionError, UnsupportedSchemaError
from agent_infer.grammar import CompiledGrammar, Grammar, GrammarCompiler, GrammarMatcher, TokenizerInfo


@pytest.fixture(scope="module")
def byte_compiler() -> GrammarCompiler:
    return GrammarCompiler(TokenizerInfo.bytes_only(), cache_enabled=False)


def _accepts(compiled: CompiledGrammar, text: str) -> bool:
    m = GrammarMatcher(compiled)
    return m.accept_string(text) and m.can_terminate()


# Wrong acceptances the exactness sweep found (schema, an invalid instance the grammar took).
FOUND = [
    (
        {
            "type": "object",
            "properties": {"b": {}},
            "patternProperties": {"b": {"type": "string"}},
            "not": {"maxProperties": 1},
            "oneOf": [{"maxProperties": 1}, {"required": ["c"]}],
        },
        '{"a":1}',
    ),
    (
        {
            "properties": {"a": {}},
            "required": ["a", "b"],
            "anyOf": [{"required": ["a"]}, {"maxProperties": 0}],
        },
        "{}",
    ),
    ({"type": "object", "required": ["b", "c"], "maxProperties": 0, "not": {"minProperties": 2}}, "{}"),
    (
        {"properties": {"a": {}}, "required": ["a"], "maxProperties": 3, "dependentRequired": {"b": ["c"]}},
        "{}",
    ),
    (
        {
            "type": "string",
            "enum": ["", "ab"],
            "const": "abcde",
            "oneOf": [{"maxLength": 1}, {"pattern": "a"}],
        },
        '"abcde"',
    ),
    ({"exclusiveMinimum": 1.5, "enum": [1, 2, 3, 4.5], "const": 2.5, "not": {"const": 1}}, "2.5"),
    (
        {
            "required": ["a", "b"],
            "oneOf": [{"required": ["a"]}, {"required": ["b"]}],
            "enum": [{"a": 1, "b": 2}, {"c": 1}],
        },
        '{"a":1,"b":2}',
    ),
]


def test_enum_objects_are_checked_member_by_member(byte_compiler: GrammarCompiler) -> None:
    """A listed object is valid whatever order its members come in (the grammar's declared order
    is a policy for generated text, not for the schema's own values)."""
    for logic in (
        {"anyOf": [{"required": ["a"]}, {"maxProperties": 0}]},
        {"not": {"properties": {"b": {"type": "string"}}}},
        {"oneOf": [{"required": ["a"], "properties": {"b": {"type": "integer"}}}, {"required": ["c"]}]},
    ):
        schema = {"properties": {"b": {}}, "enum": [{"a": 1, "b": 2}, {"c": "x"}], **logic}
        compiled = byte_compiler.compile(Grammar.from_json_schema(schema, whitespace="compact"))
        assert _accepts(compiled, '{"a":1,"b":2}'), schema
    nested = {"items": {"properties": {"b": {}}}, "enum": [[{"a": 1, "b": 2}]], "not": {"maxItems": 0}}
    compiled = byte_compiler.compile(Grammar.from_json_schema(nested, whitespace="compact"))
    assert _accepts(compiled, '[{"a":1,"b":2}]')


@pytest.mark.parametrize(("schema", "text"), FOUND)
def test_found_wrong_acceptances(schema: Any, text: str, byte_compiler: GrammarCompiler) -> None:
    assert not _oracle(schema).is_valid(json.loads(text, parse_float=Decimal))
    try:
        compiled = byte_compiler.compile(Grammar.from_json_schema(schema, whitespace="compact"))
    except GrammarDefinitionError as exc:
        assert "empty" in str(exc)
        return
    assert not _accepts(compiled, text)


# -- the exactness sweep ------------------------------------------------------------------------------

CANDIDATES: list[Any] = [
    *({}, {"a": 1}, {"b": 1}, {"c": 1}, {"x": "s"}, {"a": 1, "b": 2}, {"a": 1, "c": 3}, {"b": 1, "c": 2}),
    *({"a": "s", "x": 1}, {"a": 1, "b": 2, "c": 3}, {"xa": 1, "xb": "t"}, {"a": None}, {"ab": 1}),
    *([], [1], [2], ["a"], [1, 1], [1, 2], [2, 1], [1, "a"], ["a", 1], [1, 2, 3], [1, 1, 1], [None], [{}]),
    *([3, 3], [1, 2, 2], [0, 1, 2, 3], ["a", "a"], [1.5]),
    *("", "a", "b", "ab", "ba", "abc", "aaaa", "1", "12", "a1", "abcde", "2020-01-01", "x@y.z", "\u00e9"),
    *(-3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15, 0.5, 1.5, 2.5, 3.0, -0.5, 0.25, 4.5, 7.5, 0.3),
    *(None, True, False),
]


def _pick(rng: random.Random, p: float, options: list[Any]) -> Any:
    return rng.choice(options) if rng.random() < p else None


def _object(rng: random.Random) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "object"} if rng.random() < 0.8 else {}
    choices: dict[str, tuple[float, list[Any]]] = {
        "properties": (0.6, [{"a": {}}, {"a": {"type": "integer"}}, {"a": {}, "b": {}}, {"b": {}}]),
        "required": (0.7, [["a"], ["a", "b"], ["c"], ["b", "c"], ["a", "c"], []]),
        "minProperties": (0.6, [0, 1, 2, 3]),
        "maxProperties": (0.6, [0, 1, 2, 3]),
        "additionalProperties": (0.3, [False, {"type": "string"}, {"type": "integer"}]),
        "patternProperties": (0.25, [{"^x": {}}, {"^x": {"type": "integer"}}, {"b": {"type": "string"}}]),
        "propertyNames": (0.2, [{"maxLength": 1}, {"enum": ["a", "b"]}, {"pattern": "^[ab]$"}, False]),
        "dependentRequired": (0.2, [{"a": ["b"]}, {"b": ["c"]}]),
        "dependentSchemas": (0.15, [{"a": {"maxProperties": 1}}, {"a": {"required": ["c"]}}]),
        "not": (0.15, [{"required": ["a"]}, {"maxProperties": 1}, {"minProperties": 2}]),
        "oneOf": (
            0.15,
            [[{"required": ["a"]}, {"required": ["b"]}], [{"maxProperties": 1}, {"required": ["c"]}]],
        ),
        "anyOf": (
            0.15,
            [[{"required": ["a"]}, {"maxProperties": 0}], [{"minProperties": 2}, {"required": ["c"]}]],
        ),
        "enum": (0.1, [[{}, {"a": 1}], [{"a": 1, "b": 2}, {"c": 1}]]),
    }
    return _fill(rng, s, choices, [{"maxProperties": 1}, {"required": ["b"]}, {"minProperties": 2}])


def _array(rng: random.Random) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "array"} if rng.random() < 0.8 else {}
    choices: dict[str, tuple[float, list[Any]]] = {
        "prefixItems": (0.4, [[{"type": "integer"}], [{"const": 1}, {}], [{}, {"type": "string"}]]),
        "items": (0.4, [False, {"type": "integer"}, {"type": "string"}, {"maximum": 2}]),
        "minItems": (0.5, [0, 1, 2, 3]),
        "maxItems": (0.5, [0, 1, 2, 3]),
        "contains": (0.3, [{"const": 1}, {"type": "string"}, {"minimum": 2}, True, False]),
        "minContains": (0.2, [0, 1, 2]),
        "maxContains": (0.2, [0, 1, 2]),
        "uniqueItems": (0.2, [True, False]),
        "not": (0.1, [{"maxItems": 1}, {"contains": {"const": 1}}, {"minItems": 2}]),
        "oneOf": (
            0.1,
            [[{"maxItems": 1}, {"minItems": 3}], [{"items": {"type": "integer"}}, {"minItems": 2}]],
        ),
        "enum": (0.1, [[[], [1], [1, 2]], [[1, 1], ["a"]]]),
    }
    return _fill(rng, s, choices, [{"maxItems": 1}, {"minItems": 2}, {"items": {"type": "integer"}}])


def _string(rng: random.Random) -> dict[str, Any]:
    s: dict[str, Any] = {"type": "string"} if rng.random() < 0.8 else {}
    choices: dict[str, tuple[float, list[Any]]] = {
        "minLength": (0.6, [0, 1, 2, 3, 4]),
        "maxLength": (0.6, [0, 1, 2, 3, 4]),
        "pattern": (0.3, ["^a", "b", "^[a-z]*$", "^.{2}$", "\\d", "^$"]),
        "format": (0.15, ["date", "email"]),
        "enum": (0.2, [["", "a", "ab", "abc"], ["abcde", 1, "b"], ["1", None]]),
        "const": (0.1, ["ab", "", "abcde"]),
        "not": (0.1, [{"minLength": 2}, {"const": "a"}, {"pattern": "^a"}, {"enum": ["", "b"]}]),
        "oneOf": (0.1, [[{"maxLength": 1}, {"pattern": "a"}], [{"minLength": 2}, {"const": "a"}]]),
    }
    return _fill(rng, s, choices, [{"maxLength": 1}, {"minLength": 2}, {"pattern": "^a"}])


def _number(rng: random.Random) -> dict[str, Any]:
    s: dict[str, Any] = {"type": rng.choice(["integer", "number"])} if rng.random() < 0.8 else {}
    bounds = [-1, 0, 1, 2, 2.5, 3, 5, 7.5, 10, 0.5, 1.5]
    choices: dict[str, tuple[float, list[Any]]] = {
        **{k: (0.35, bounds) for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")},
        "multipleOf": (0.35, [2, 3, 0.5, 1.5, 0.25, 1, 2.5, 0.1]),
        "enum": (0.2, [[1, 2, 3, 4.5], [0.5, 1.5, "a"], [3.0, 5, 10]]),
        "const": (0.1, [3, 2.5, 0]),
        "not": (0.1, [{"multipleOf": 2}, {"minimum": 3}, {"const": 1}, {"type": "integer"}]),
        "oneOf": (0.1, [[{"multipleOf": 2}, {"multipleOf": 3}], [{"minimum": 3}, {"maximum": 5}]]),
    }
    return _fill(rng, s, choices, [{"multipleOf": 3}, {"maximum": 4}, {"exclusiveMinimum": 1}])


def _fill(
    rng: random.Random, s: dict[str, Any], choices: dict[str, tuple[float, list[Any]]], merged: list[Any]
) -> dict[str, Any]:
    for key, (p, options) in choices.items():
        value = _pick(rng, p, options)
        if value is not None:
            s[key] = value
    if_then = _pick(
        rng, 0.1, [({"minimum": 3}, {"multipleOf": 2}), ({"required": ["a"]}, {"maxProperties": 1})]
    )
    if if_then is not None:
        s["if"], s["then"] = if_then
    # allOf is flattened by merging, a path of its own: some schemas go through it.
    return {"allOf": [s, rng.choice(merged)]} if rng.random() < 0.15 else s


def _mixed(rng: random.Random) -> dict[str, Any]:
    """Keywords of two types side by side (each applies to its own type only)."""
    s: dict[str, Any] = {}
    for make in rng.sample([_object, _array, _string, _number], 2):
        s.update({k: v for k, v in make(rng).items() if k not in ("type", "allOf")})
    return s


def _schemas() -> list[Any]:
    rng = random.Random(20261204)
    makers = [_object, _array, _string, _number, _mixed]
    out: list[Any] = [makers[i % len(makers)](rng) for i in range(1500)]
    # Every required/count combination, exhaustively (the family of the wrong `{}`).
    for props, req, lo, hi, extra in itertools.product(
        ({}, {"a": {}}, {"a": {}, "b": {}}),
        ([], ["a"], ["c"], ["a", "c"]),
        (0, 1, 2),
        (None, 0, 1, 2),
        (True, False),
    ):
        s: dict[str, Any] = {"type": "object", "properties": props, "required": req, "minProperties": lo}
        s.update({} if hi is None else {"maxProperties": hi})
        out.append(s if extra else {**s, "additionalProperties": False})
    # As a member value, an array item and through $ref, where the object is not at the root.
    out += [{"type": "array", "items": s, "maxItems": 1} for s in out[1500:1540]]
    out += [{"$defs": {"d": s}, "$ref": "#/$defs/d"} for s in out[:40]]
    return out


def _integer(checker: Any, v: Any) -> bool:
    if isinstance(v, Decimal):
        return v == v.to_integral_value()
    return bool(jsonschema.Draft202012Validator.TYPE_CHECKER.is_type(v, "integer"))


_Exact = jsonschema.validators.extend(
    jsonschema.Draft202012Validator,
    type_checker=jsonschema.Draft202012Validator.TYPE_CHECKER.redefine("integer", _integer),
)


def _oracle(schema: Any) -> Any:
    """jsonschema over exact decimals (its floats would call 0.3 no multiple of 0.1; 3.0 stays
    an integer)."""
    exact = json.loads(json.dumps(schema), parse_float=Decimal)
    return _Exact(exact, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


def _instances(schema: Any) -> list[Any]:
    if schema.get("type") == "array" and "items" in schema and "$defs" not in schema:
        return [[x] for x in CANDIDATES]
    return CANDIDATES


def _spellings(v: Any) -> list[str]:
    """Texts of ``v`` under the documented false negatives: members in any order, 3.0 as 3."""
    if isinstance(v, float) and v.is_integer():
        return [json.dumps(int(v))]
    if isinstance(v, dict):
        return [json.dumps(dict(p), separators=(",", ":")) for p in itertools.permutations(v.items())]
    if isinstance(v, list) and len(v) == 1:
        return [f"[{t}]" for t in _spellings(v[0])]
    return []


def test_exactness_against_jsonschema(byte_compiler: GrammarCompiler) -> None:
    """No accepted instance is invalid; a rejected valid one must be a documented false negative."""
    false_accepts: list[str] = []
    false_rejects: list[str] = []
    compiled_count = 0
    for schema in _schemas():
        try:
            compiled: CompiledGrammar | None = byte_compiler.compile(
                Grammar.from_json_schema(schema, whitespace="compact")
            )
        except UnsupportedSchemaError:
            continue
        except GrammarDefinitionError as exc:
            assert "empty" in str(exc), (schema, exc)
            compiled = None  # an empty language: every instance must be invalid
        compiled_count += 1
        oracle = _oracle(schema)
        for inst in _instances(schema):
            text = json.dumps(inst, separators=(",", ":"), ensure_ascii=False)
            got = compiled is not None and _accepts(compiled, text)
            valid = oracle.is_valid(json.loads(text, parse_float=Decimal))
            if got and not valid:
                false_accepts.append(f"{json.dumps(schema)} accepts {text}")
            elif (valid and not got) and (
                compiled is None or not any(_accepts(compiled, t) for t in _spellings(inst))
            ):
                false_rejects.append(f"{json.dumps(schema)} rejects {text}")
    assert compiled_count > 1200
    assert not false_accepts, "\n".join(false_accepts[:30])
    assert not false_rejects, "\n".join(false_rejects[:30])


@pytest.mark.parametrize("layout", [{"indent": 2}, {"whitespace": "flexible"}])
def test_no_false_accepts_in_other_layouts(layout: dict[str, Any], byte_compiler: GrammarCompiler) -> None:
    """Empty containers and separators are written per layout (``{}`` with blank inside, pinned
    newlines): a sample of the sweep, texts as json.dumps(indent=2) writes them."""
    false_accepts = []
    for schema in _schemas()[::4]:
        try:
            compiled = byte_compiler.compile(Grammar.from_json_schema(schema, **layout))
        except (UnsupportedSchemaError, GrammarDefinitionError):
            continue
        oracle = _oracle(schema)
        for inst in _instances(schema):
            text = json.dumps(inst, indent=2, ensure_ascii=False)
            if _accepts(compiled, text) and not oracle.is_valid(json.loads(text, parse_float=Decimal)):
                false_accepts.append(f"{json.dumps(schema)} accepts {text!r}")
    assert not false_accepts, "\n".join(false_accepts[:30])
