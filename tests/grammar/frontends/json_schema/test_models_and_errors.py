"""Pydantic models, error pointers, non-strict warnings and limits of the JSON Schema compiler."""

from __future__ import annotations

import enum
import json
from typing import Literal, Optional

import pytest
from pydantic import BaseModel

from agent_infer.errors import GrammarLimitError, InvalidSchemaError, UnsupportedSchemaError
from agent_infer.grammar import Grammar, GrammarCompiler, TokenizerInfo
from agent_infer.grammar.frontends.json_schema import json_schema_to_grammar
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Address(BaseModel):
    street: str
    zip: Optional[int] = None  # noqa: UP045 - exercise the typing spelling Pydantic sees


class Person(BaseModel):
    name: str
    kind: Literal["admin", "user"]
    color: Color
    tags: list[str]
    address: Address | None = None


class Tree(BaseModel):
    value: int
    children: list[Tree] = []


def _rec(schema: object, **kw: object) -> ReferenceRecognizer:
    return ReferenceRecognizer(json_schema_to_grammar(schema, **kw))  # type: ignore[arg-type]


def test_pydantic_model_nested_optional_literal_enum_list() -> None:
    rec = ReferenceRecognizer(Grammar.from_json_schema(Person))
    good = Person(name="a", kind="user", color=Color.RED, tags=["x"], address=Address(street="s", zip=1))
    assert rec.accepts(good.model_dump_json())
    assert rec.accepts(
        json.dumps({"name": "a", "kind": "admin", "color": "green", "tags": [], "address": None})
    )
    assert not rec.accepts(json.dumps({"name": "a", "kind": "root", "color": "red", "tags": []}))
    assert not rec.accepts(json.dumps({"name": "a", "kind": "user", "color": "blue", "tags": []}))
    assert not rec.accepts(json.dumps({"name": "a", "kind": "user", "color": "red"}))


def test_recursive_pydantic_model() -> None:
    rec = _rec(Tree)
    assert rec.accepts(Tree(value=1, children=[Tree(value=2, children=[Tree(value=3)])]).model_dump_json())
    assert not rec.accepts('{"value":1,"children":[{"value":"x"}]}')


def test_json_text_input_and_shared_rules() -> None:
    schema = {"type": "object", "properties": {k: {"type": "string", "maxLength": 5} for k in "abcdef"}}
    g = json_schema_to_grammar(json.dumps(schema))
    assert sum(1 for name, _ in g.rules if name.startswith("properties")) == 1


@pytest.mark.parametrize(
    ("schema", "pointer"),
    [
        ({"type": "string", "minLength": "x"}, "/minLength"),
        ({"properties": {"a": {"type": "object", "required": 3}}}, "/properties/a/required"),
        ({"type": "strng"}, "/type"),
        ({"$ref": "#/$defs/missing"}, "/$ref"),
        ({"items": {"pattern": "("}, "type": "array"}, "/items/pattern"),
        ({"anyOf": []}, "/anyOf"),
        ({"type": "array", "maxItems": -1}, "/maxItems"),
        ({"type": "number", "multipleOf": 0}, "/multipleOf"),
        ({"enum": "a"}, "/enum"),
        ({"$defs": {"x": {"pattern": 5}}, "type": "integer"}, "/$defs/x/pattern"),
    ],
)
def test_invalid_schemas_name_the_pointer(schema: object, pointer: str) -> None:
    with pytest.raises(InvalidSchemaError) as info:
        json_schema_to_grammar(schema)  # type: ignore[arg-type]
    assert info.value.pointer == pointer


@pytest.mark.parametrize(
    ("schema", "keyword", "pointer"),
    [
        ({"if": {"type": "string", "format": "email"}, "then": {"minLength": 3}}, "if", "/if"),
        (
            {"properties": {"a": {"type": "array", "items": {"maxLength": 3}, "uniqueItems": True}}},
            "uniqueItems",
            "/properties/a/uniqueItems",
        ),
        ({"oneOf": [{"type": "string", "format": "email"}, {"maxLength": 5}]}, "oneOf", "/oneOf"),
        ({"type": "string", "format": "iri"}, "format", "/format"),
        ({"not": {"format": "email"}}, "not", "/not"),
        ({"$ref": "https://example.com/remote.json"}, "$ref", "/$ref"),
    ],
)
def test_unsupported_keywords_carry_keyword_and_pointer(schema: object, keyword: str, pointer: str) -> None:
    with pytest.raises(UnsupportedSchemaError) as info:
        json_schema_to_grammar(schema)  # type: ignore[arg-type]
    assert (info.value.keyword, info.value.pointer) == (keyword, pointer)


def test_non_strict_records_warnings_and_compiles_the_rest() -> None:
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "array", "items": {"type": "integer", "maximum": 9}, "uniqueItems": True},
            "b": {"type": "string", "format": "iri"},
        },
    }
    g = json_schema_to_grammar(schema, strict=False)
    assert any(w.startswith("ignored keyword uniqueItems at /properties/a/uniqueItems") for w in g.warnings)
    assert any(w.startswith("ignored keyword format at /properties/b/format") for w in g.warnings)
    rec = ReferenceRecognizer(g)
    assert rec.accepts('{"a":[1,1],"b":"red"}')
    assert not rec.accepts('{"a":["x"]}')


def test_non_strict_drops_an_uncompilable_pattern() -> None:
    g = json_schema_to_grammar({"type": "string", "pattern": "(?<=a)b", "maxLength": 3}, strict=False)
    assert any("pattern at /pattern" in w for w in g.warnings)
    rec = ReferenceRecognizer(g)
    assert rec.accepts('"zzz"')
    assert not rec.accepts('"zzzz"')


def test_annotations_and_vendor_extensions_are_ignored() -> None:
    schema = {
        "type": "integer",
        "title": "t",
        "description": "d",
        "default": 1,
        "examples": [1],
        "x-foo": 1,
        "$comment": "c",
        "deprecated": True,
        "readOnly": True,
    }
    assert _rec(schema).accepts("5")


def test_large_counts_use_chunks_or_doubling_rules() -> None:
    """Long strings become 256-character chunks plus a counted tail; huge ones doubling rules."""
    from agent_infer.grammar.ir import Repeat, walk

    def counts(g: Grammar) -> list[int]:
        return [n.max for _, e in g.rules for n in walk(e) if isinstance(n, Repeat) and n.max is not None]

    g = json_schema_to_grammar({"type": "string", "minLength": 3, "maxLength": 1000})
    assert max(counts(g)) <= 256 and len(g.rules) < 60
    rec = ReferenceRecognizer(g)
    # 1000 = 3 + 3 * 256 + 229: the lengths around every chunk boundary and both ends.
    for n in (3, 4, 258, 259, 260, 514, 515, 770, 771, 772, 999, 1000):
        assert rec.accepts('"' + "x" * n + '"'), n
    for n in (0, 2, 1001, 1030):
        assert not rec.accepts('"' + "x" * n + '"'), n

    g = json_schema_to_grammar({"type": "string", "minLength": 3, "maxLength": 10**6})
    assert max(counts(g)) <= 256 and len(g.rules) < 80
    rec = ReferenceRecognizer(g)
    assert rec.accepts('"' + "x" * 300 + '"') and not rec.accepts('"xx"')


def test_limits_raise_grammar_limit_error() -> None:
    # The product with maxLength is over the front end's state limit, so the bound is counted at
    # run time; the pattern's own automaton (2^21 states) is over the compiler's.
    schema = {"type": "string", "pattern": "^(a|b)*a(a|b){20}$", "maxLength": 400}
    with pytest.raises(GrammarLimitError, match="automaton states"):
        GrammarCompiler(TokenizerInfo.bytes_only(), cache_enabled=False).compile(
            Grammar.from_json_schema(schema)
        )


def test_unknown_non_typo_keyword_is_an_annotation_with_a_warning() -> None:
    grammar = Grammar.from_json_schema({"type": "integer", "frobnicate": 1})
    assert any("frobnicate" in w and "annotation" in w for w in grammar.warnings)


def test_likely_typo_names_the_real_keyword() -> None:
    warnings = Grammar.from_json_schema({"type": "integer", "mininum": 3}).warnings
    assert warnings == (
        "ignored unknown keyword mininum at /mininum: treated as an annotation (did you mean 'minimum'?)",
    )
    with pytest.raises(UnsupportedSchemaError, match="did you mean 'minimum'"):
        Grammar.from_json_schema({"type": "integer", "mininum": 3}, unknown_keywords="error")


def test_pydantic_models_generate_closed_objects() -> None:
    from pydantic import BaseModel, ConfigDict

    class Inner(BaseModel):
        x: int

    class Outer(BaseModel):
        inner: Inner

    class Open(BaseModel):
        model_config = ConfigDict(extra="allow")
        y: int

    from agent_infer.grammar.ir.recognizer import ReferenceRecognizer

    closed = ReferenceRecognizer(Grammar.from_json_schema(Outer, whitespace="compact"))
    assert closed.accepts('{"inner":{"x":1}}')
    assert not closed.accepts('{"inner":{"x":1},"z":2}')
    assert not closed.accepts('{"inner":{"x":1,"z":2}}')
    opened = ReferenceRecognizer(Grammar.from_json_schema(Open, whitespace="compact"))
    assert opened.accepts('{"y":1,"z":2}')


def test_enum_checked_against_its_own_recursive_schema_is_a_typed_error() -> None:
    """Non-strict mode filters enum values through the schema beside them; when that schema
    contains the same check again (a recursive $ref) the answer is a typed error, not a crash."""
    schema = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "tag": {"enum": [{"kind": "leaf"}, 3], "x-custom": True, "$ref": "#/$defs/node"},
                },
            }
        },
        "$ref": "#/$defs/node",
    }
    with pytest.raises(UnsupportedSchemaError) as info:
        Grammar.from_json_schema(schema, strict=False)
    assert info.value.keyword == "enum" and info.value.pointer.startswith("/properties/tag")


def test_schema_nested_beyond_the_recursion_limit_is_a_limit_error() -> None:
    schema: dict[str, object] = {"type": "integer"}
    for _ in range(3000):
        schema = {"type": "array", "items": schema}
    with pytest.raises(GrammarLimitError, match="nests too deeply"):
        Grammar.from_json_schema(schema)


def test_lowering_has_a_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Conditionals that multiply (nested if/then under anyOf) would reach the rule-count limit only
    after ~10 s; the lowering stops at its time limit instead, with a typed error naming it."""
    from agent_infer.errors import ConfigError

    schema = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}}},
    }
    monkeypatch.setenv("AGENT_INFER_JSON_SCHEMA_MAX_SECONDS", "0")
    with pytest.raises(GrammarLimitError, match="time limit of 0 s"):
        json_schema_to_grammar(schema)
    monkeypatch.setenv("AGENT_INFER_JSON_SCHEMA_MAX_SECONDS", "soon")
    with pytest.raises(ConfigError, match="AGENT_INFER_JSON_SCHEMA_MAX_SECONDS"):
        json_schema_to_grammar(schema)
    monkeypatch.delenv("AGENT_INFER_JSON_SCHEMA_MAX_SECONDS")
    assert ReferenceRecognizer(json_schema_to_grammar(schema, whitespace="compact")).accepts('{"a":{"b":1}}')
