"""JSON Schema front end: exact languages for combined keywords, typed errors for bad numbers and options.

The exactness sweep compiles many small schemas that combine keywords lowered by separate code
paths (``required`` with property counts, ``enum``/``const`` with siblings, item counts with
``prefixItems``/``contains``, lengths with patterns/formats, bounds with ``multipleOf``) and checks
the grammar against ``jsonschema`` on enumerated candidate instances, with the real native matcher
on the bytes-only vocabulary.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from agent_infer.errors import (
    ConfigError,
    GrammarDefinitionError,
    GrammarLimitError,
    InvalidSchemaError,
    UnsupportedSchemaError,
)
from agent_infer.grammar import (
    CompiledGrammar,
    Grammar,
    GrammarCompiler,
    GrammarMatcher,
    TokenizerInfo,
    allocate_token_bitmask,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_grammar_core_support import deepseek_tokenizer_path


@pytest.fixture(scope="module")
def byte_compiler() -> GrammarCompiler:
    return GrammarCompiler(TokenizerInfo.bytes_only(), cache_enabled=False)


@pytest.fixture(scope="module")
def deepseek() -> GrammarCompiler:
    return GrammarCompiler(TokenizerInfo.from_tokenizer(deepseek_tokenizer_path()))


def _accepts(compiled: CompiledGrammar, text: str) -> bool:
    m = GrammarMatcher(compiled)
    return m.accept_string(text) and m.can_terminate()


# -- required members under property counts ---------------------------------------------------------

REQUIRED_WITH_MAX = {"type": "object", "required": ["a"], "maxProperties": 1}
EMPTY_OBJECT_CASES = {
    "plain": (REQUIRED_WITH_MAX, ""),
    "declared": ({**REQUIRED_WITH_MAX, "properties": {"a": {"type": "integer"}}}, ""),
    "allOf": ({"type": "object", "required": ["a"], "allOf": [{"maxProperties": 1}]}, ""),
    "ref": ({"$defs": {"o": REQUIRED_WITH_MAX}, "$ref": "#/$defs/o"}, ""),
    "items": ({"type": "array", "items": REQUIRED_WITH_MAX}, "["),
    "maxProperties 3": ({"type": "object", "required": ["a", "b"], "maxProperties": 3}, ""),
}


@pytest.mark.parametrize("case", sorted(EMPTY_OBJECT_CASES))
def test_required_member_excludes_the_empty_object_token(case: str, deepseek: GrammarCompiler) -> None:
    """The DeepSeek-V4 token ``{}`` must not be allowed where an object with a required member starts."""
    schema, prefix = EMPTY_OBJECT_CASES[case]
    compiled = deepseek.compile(Grammar.from_json_schema(schema))
    info = deepseek.tokenizer_info
    token = info.decoded_vocab.index(b"{}")
    m = GrammarMatcher(compiled)
    assert m.accept_string(prefix)
    bitmask = allocate_token_bitmask(1, info.vocab_size)
    m.fill_next_token_bitmask(bitmask)
    word = int(bitmask[0, token // 32]) & 0xFFFFFFFF
    assert not (word >> (token % 32)) & 1, "token '{}' allowed"
    assert not m.fork().accept_token(token)
    assert not _accepts(compiled, prefix + "{}" + ("]" if prefix else ""))
    assert _accepts(
        compiled,
        prefix
        + '{"a":1'
        + (',"b":2' if "b" in schema.get("required", ()) else "")
        + "}"
        + ("]" if prefix else ""),
    )


def test_property_count_bounds_that_cross_give_an_empty_language(byte_compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "minProperties": 3, "maxProperties": 2, "propertyNames": {"minLength": 2}}
    with pytest.raises(GrammarDefinitionError, match="empty"):
        byte_compiler.compile(Grammar.from_json_schema(schema))
    too_many = {"type": "object", "required": ["a", "b"], "maxProperties": 1}
    with pytest.raises(GrammarDefinitionError, match="empty"):
        byte_compiler.compile(Grammar.from_json_schema(too_many))


def test_const_must_also_be_listed_by_enum(byte_compiler: GrammarCompiler) -> None:
    """Both are checked, also where a logic keyword beside them sends the values down the per-value
    validity check."""
    for logic in ({}, {"not": {"const": "a"}}, {"oneOf": [{"type": "string"}, {"type": "number"}]}):
        compiled = byte_compiler.compile(Grammar.from_json_schema({"enum": [1, 2, "b"], "const": 2, **logic}))
        assert _accepts(compiled, "2") and not _accepts(compiled, "1") and not _accepts(compiled, '"b"')
        with pytest.raises(GrammarDefinitionError, match="empty"):
            byte_compiler.compile(Grammar.from_json_schema({"enum": ["a", "b"], "const": "c", **logic}))


def test_integral_float_enum_value_is_an_integer(byte_compiler: GrammarCompiler) -> None:
    """3.0 is an integer in JSON Schema: listed under ``type: integer`` it is kept, whatever checks it."""
    for schema in (
        {"type": "integer", "enum": [3.0, 2.5]},
        {"type": "integer", "minimum": 1, "enum": [3.0, 2.5]},
        {"type": "array", "items": {"type": "integer"}, "enum": [[3.0], [2.5]]},
    ):
        compiled = byte_compiler.compile(Grammar.from_json_schema(schema, whitespace="compact"))
        text = "[3]" if schema["type"] == "array" else "3"
        assert _accepts(compiled, text), schema
        assert not _accepts(compiled, text.replace("3", "2.5")), schema


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
]


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


# -- non-finite and huge numbers --------------------------------------------------------------------

COUNTS = ["minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"]
NUMBERS = ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"]
BAD_NUMBERS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan, "huge": 10**5000, "-huge": -(10**5000)}


@pytest.mark.parametrize("keyword", [*COUNTS, "minContains", "maxContains", *NUMBERS])
@pytest.mark.parametrize("bad", sorted(BAD_NUMBERS))
def test_non_finite_or_huge_keyword_is_invalid_schema(keyword: str, bad: str) -> None:
    schema = {"type": "array", "contains": {}, "items": {keyword: BAD_NUMBERS[bad]}}
    with pytest.raises(InvalidSchemaError) as err:
        Grammar.from_json_schema(schema)
    assert err.value.pointer == f"/items/{keyword}"


@pytest.mark.parametrize("keyword", [*COUNTS, "minContains", "maxContains"])
def test_boolean_count_is_invalid_schema(keyword: str) -> None:
    with pytest.raises(InvalidSchemaError) as err:
        Grammar.from_json_schema({"properties": {"p": {keyword: True}}})
    assert err.value.pointer == f"/properties/p/{keyword}"


@pytest.mark.parametrize("bad", sorted(BAD_NUMBERS))
def test_non_finite_or_huge_enum_value_is_invalid_schema(bad: str) -> None:
    v = BAD_NUMBERS[bad]
    cases = [
        ({"enum": [1, v]}, "/enum/1"),
        ({"const": v}, "/const"),
        ({"type": "array", "items": {"enum": [["x", {"k": v}]]}}, "/items/enum/0/1/k"),
        ({"$defs": {"d": {"const": [v]}}, "$ref": "#/$defs/d"}, "/$defs/d/const/0"),
    ]
    for schema, pointer in cases:
        with pytest.raises(InvalidSchemaError) as err:
            Grammar.from_json_schema(schema)
        assert err.value.pointer == pointer, schema


BIG = "1" + "0" * 5000
JSON_TEXTS = {
    '{"minLength": NaN}': "/minLength",
    '{"maximum": Infinity}': "/maximum",
    '{"properties": {"a": {"exclusiveMinimum": -Infinity}}}': "/properties/a/exclusiveMinimum",
    '{"minimum": 1e999}': "/minimum",
    '{"type": "string", "maxLength": 1e400}': "/maxLength",
    '{"const": [NaN]}': "/const/0",
    '{"maxItems": ' + BIG + "}": "/maxItems",
    '{"multipleOf": -' + BIG + "}": "/multipleOf",
    '{"anyOf": [{"enum": [1, ' + BIG + "]}]}": "/anyOf/0/enum/1",
}


@pytest.mark.parametrize("text", sorted(JSON_TEXTS))
def test_schema_text_with_bad_numbers_is_invalid_schema(text: str) -> None:
    with pytest.raises(InvalidSchemaError) as err:
        Grammar.from_json_schema(text)
    assert err.value.pointer == JSON_TEXTS[text]


def test_long_integer_in_an_annotation_is_ignored(byte_compiler: GrammarCompiler) -> None:
    compiled = byte_compiler.compile(Grammar.from_json_schema('{"type": "integer", "default": ' + BIG + "}"))
    assert _accepts(compiled, "12")


@pytest.mark.parametrize("keyword", ["minLength", "maxItems", "maxProperties"])
def test_count_above_the_limit_names_its_keyword(keyword: str) -> None:
    for value in (2**64, 1e308):
        with pytest.raises(GrammarLimitError, match=f"{keyword} at /properties/p/{keyword}"):
            Grammar.from_json_schema({"properties": {"p": {keyword: value}}})
    if keyword != "maxProperties":  # property counts have their own, lower, state limit
        Grammar.from_json_schema({"properties": {"p": {keyword: 2**64 - 1}}})


def test_long_numbers_are_written_exactly(byte_compiler: GrammarCompiler) -> None:
    """Values of thousands of digits (within the int-to-str limit) and bounds of hundreds compile:
    the common digits of a range are one literal."""
    big = 10**4299
    const = byte_compiler.compile(Grammar.from_json_schema({"const": -big}))
    assert _accepts(const, str(-big)) and not _accepts(const, str(-big - 1))
    bound = 10**399  # MAX_NUMBER_DIGITS digits
    below = byte_compiler.compile(Grammar.from_json_schema({"type": "number", "maximum": -bound}))
    assert _accepts(below, str(-bound)) and _accepts(below, str(-bound - 1) + ".5")
    assert not _accepts(below, str(-bound + 1))
    doubles = {"type": "number", "minimum": -1.7976931348623157e308, "maximum": 1.7976931348623157e308}
    compiled = byte_compiler.compile(Grammar.from_json_schema(doubles))
    assert _accepts(compiled, "-12.5") and _accepts(compiled, str(17976931348623157 * 10**292))
    assert not _accepts(compiled, str(17976931348623157 * 10**292 + 1))
    tiny = byte_compiler.compile(Grammar.from_json_schema({"type": "number", "exclusiveMinimum": 5e-324}))
    assert _accepts(tiny, "0." + "0" * 323 + "6") and not _accepts(tiny, "0." + "0" * 323 + "5")


@pytest.mark.parametrize(
    ("keyword", "value"),
    [
        ("minimum", 10**300 + 1),
        ("maximum", -int("7" * 101)),
        ("exclusiveMinimum", 10**400),
        ("exclusiveMaximum", -(10**401)),
        ("multipleOf", 10**4000),
    ],
    ids=["301-significant", "101-significant", "401-digits", "402-digits", "above-modulus-limit"],
)
def test_number_beyond_the_digit_limits_names_its_keyword(keyword: str, value: Any) -> None:
    with pytest.raises(GrammarLimitError, match=f"{keyword} at /items/{keyword}"):
        Grammar.from_json_schema({"type": "array", "items": {"type": "number", keyword: value}})


# -- options --------------------------------------------------------------------------------------


BAD_OPTIONS = [
    ("indent", 10**6, "0 to 16"),
    ("indent", -1, "0 to 16"),
    ("indent", 2.0, "0 to 16"),
    ("indent", True, "0 to 16"),
    ("indent", "  ", "0 to 16"),
    ("max_whitespace", 10**9, "0 to 64"),
    ("max_whitespace", -1, "0 to 64"),
    ("max_whitespace", None, "0 to 64"),
    ("whitespace", "tabs", "'flexible' or 'compact'"),
    ("strict", "no", "True or False"),
    ("remotes", [1], "mapping"),
]


@pytest.mark.parametrize(("name", "value", "allowed"), BAD_OPTIONS)
def test_out_of_range_option_is_config_error(
    name: str, value: Any, allowed: str, byte_compiler: GrammarCompiler
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}
    for build in (
        lambda: Grammar.from_json_schema(schema, **{name: value}),
        lambda: byte_compiler.compile_json_schema(schema, **{name: value}),
    ):
        with pytest.raises(ConfigError, match=name) as err:
            build()
        assert allowed in str(err.value)


def test_unknown_compile_json_schema_option_is_config_error(byte_compiler: GrammarCompiler) -> None:
    with pytest.raises(ConfigError, match="indnt"):
        byte_compiler.compile_json_schema({"type": "integer"}, indnt=2)


def test_largest_options_compile_and_match(byte_compiler: GrammarCompiler) -> None:
    value = {"a": [1, {"b": [2]}]}
    schema = {"type": "object", "properties": {"a": {"type": "array"}}}
    pinned = byte_compiler.compile_json_schema(schema, indent=16)
    assert _accepts(pinned, json.dumps(value, indent=16))
    assert not _accepts(pinned, json.dumps(value, indent=15))
    flexible = byte_compiler.compile_json_schema(schema, max_whitespace=64)
    assert _accepts(flexible, "{" + " " * 64 + '"a"' + " " * 64 + ":[]}")
    assert not _accepts(flexible, "{" + " " * 65 + '"a":[]}')
