"""Unknown ``format`` values and unknown keywords are annotations (draft 2020-12): they compile,
constrain nothing, and are reported as warnings with their JSON pointers, unless the
``unknown_formats`` / ``unknown_keywords`` switch asks for an error."""

from __future__ import annotations

import pytest

from agent_infer.errors import ConfigError, GrammarDefinitionError, UnsupportedSchemaError
from agent_infer.grammar import Grammar, GrammarCompiler, GrammarMatcher, TokenizerInfo
from agent_infer.grammar.compile.compiler import CompiledGrammar
from agent_infer.sampling_params import SamplingParams
from agent_infer.structured import StructuredOutput

UNKNOWN_FORMAT = {"type": "object", "properties": {"colour": {"type": "string", "format": "hex-colour"}}}


@pytest.fixture(scope="module")
def byte_compiler() -> GrammarCompiler:
    return GrammarCompiler(TokenizerInfo.bytes_only())


def _accepts(compiled: CompiledGrammar, text: str) -> bool:
    m = GrammarMatcher(compiled)
    return m.accept_string(text) and m.can_terminate()


@pytest.mark.parametrize("strict", [True, False])
def test_unknown_format_is_any_string_with_a_warning(byte_compiler: GrammarCompiler, strict: bool) -> None:
    compiled = byte_compiler.compile(Grammar.from_json_schema(UNKNOWN_FORMAT, strict=strict))
    assert compiled.warnings == (
        "ignored unknown format 'hex-colour' at /properties/colour/format: treated as an annotation",
    )
    for value in ('""', '"#fff"', '"not a colour"', '"\\u00e9"'):
        assert _accepts(compiled, '{"colour":' + value + "}")
    assert not _accepts(compiled, '{"colour":1}')


def test_unknown_format_leaves_the_other_string_keywords_enforced(byte_compiler: GrammarCompiler) -> None:
    schema = {"type": "string", "format": "phone", "pattern": "^[0-9]+$", "maxLength": 3}
    compiled = byte_compiler.compile(Grammar.from_json_schema(schema))
    assert [_accepts(compiled, t) for t in ('"123"', '"1234"', '"12a"', '""')] == [True, False, False, False]
    assert compiled.warnings == ("ignored unknown format 'phone' at /format: treated as an annotation",)


def test_enum_values_under_an_unknown_format_are_all_kept(byte_compiler: GrammarCompiler) -> None:
    compiled = byte_compiler.compile(Grammar.from_json_schema({"enum": ["a", "b"], "format": "letter"}))
    assert _accepts(compiled, '"a"') and _accepts(compiled, '"b"') and not _accepts(compiled, '"c"')
    assert any("unknown format 'letter' at /format" in w for w in compiled.warnings)


def test_unknown_formats_error_refuses_with_the_pointer() -> None:
    with pytest.raises(UnsupportedSchemaError, match="unknown format 'hex-colour'") as err:
        Grammar.from_json_schema(UNKNOWN_FORMAT, unknown_formats="error")
    assert (err.value.keyword, err.value.pointer) == ("format", "/properties/colour/format")
    # "error" is the user's request: it holds in non-strict mode too.
    with pytest.raises(UnsupportedSchemaError):
        Grammar.from_json_schema(UNKNOWN_FORMAT, strict=False, unknown_formats="error")


def test_known_formats_stay_enforced_and_unimplemented_ones_refused(byte_compiler: GrammarCompiler) -> None:
    email = byte_compiler.compile(Grammar.from_json_schema({"type": "string", "format": "email"}))
    assert _accepts(email, '"a@example.com"') and not _accepts(email, '"not an email"')
    assert email.warnings == ()
    # A format the specification defines is a constraint: one the front end cannot check is refused.
    with pytest.raises(UnsupportedSchemaError) as err:
        Grammar.from_json_schema({"type": "string", "format": "idn-hostname"})
    assert err.value.pointer == "/format"


def test_unknown_format_under_property_names_is_an_annotation(byte_compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "propertyNames": {"format": "slug", "maxLength": 2}}
    compiled = byte_compiler.compile(Grammar.from_json_schema(schema))
    assert _accepts(compiled, '{"ab":1}') and not _accepts(compiled, '{"abc":1}')
    assert compiled.warnings == (
        "ignored unknown format 'slug' at /propertyNames/format: treated as an annotation",
    )


def test_typo_keyword_warns_with_the_hint_and_pointer(byte_compiler: GrammarCompiler) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLenght": 3}}}
    compiled = byte_compiler.compile(Grammar.from_json_schema(schema))
    assert compiled.warnings == (
        "ignored unknown keyword maxLenght at /properties/name/maxLenght: treated as an annotation "
        "(did you mean 'maxLength'?)",
    )
    # An annotation constrains nothing: the intended bound is not enforced.
    assert _accepts(compiled, '{"name":"abcdef"}') and not _accepts(compiled, '{"name":1}')


def test_unknown_keywords_error_refuses_every_unknown_keyword() -> None:
    with pytest.raises(UnsupportedSchemaError, match="did you mean 'maxLength'") as err:
        Grammar.from_json_schema({"type": "string", "maxLenght": 3}, unknown_keywords="error")
    assert (err.value.keyword, err.value.pointer) == ("maxLenght", "/maxLenght")
    with pytest.raises(UnsupportedSchemaError, match="unknown keyword 'frobnicate' \\(keyword") as err:
        Grammar.from_json_schema({"items": {"frobnicate": 1}}, unknown_keywords="error")
    assert err.value.pointer == "/items/frobnicate"
    # Annotations the vocabulary names (and x- extensions) are not unknown keywords.
    schema = {"type": "string", "description": "d", "x-ui": 1, "format": "x"}
    assert Grammar.from_json_schema(schema, unknown_keywords="error").warnings == (
        "ignored unknown format 'x' at /format: treated as an annotation",
    )


def test_switches_reach_every_entry_point(byte_compiler: GrammarCompiler) -> None:
    with pytest.raises(UnsupportedSchemaError):
        byte_compiler.compile_json_schema(UNKNOWN_FORMAT, unknown_formats="error")
    assert byte_compiler.compile_json_schema(UNKNOWN_FORMAT, unknown_formats="ignore").warnings
    structured = StructuredOutput.json_schema(UNKNOWN_FORMAT, unknown_formats="error")
    with pytest.raises(UnsupportedSchemaError):
        SamplingParams(structured=structured).structured.to_grammar()
    with pytest.raises(ConfigError, match="unknown_formats must be 'ignore' or 'error', got 'warn'"):
        StructuredOutput.json_schema(UNKNOWN_FORMAT, unknown_formats="warn")
    with pytest.raises(ConfigError, match="unknown_keywords must be 'ignore' or 'error'"):
        StructuredOutput.json_schema(UNKNOWN_FORMAT, unknown_keywords=False)
    with pytest.raises(ConfigError, match=r"unknown option.*unknown_format\b"):
        StructuredOutput.json_schema(UNKNOWN_FORMAT, unknown_format="error")


def test_annotations_under_not_and_allof_constrain_nothing(byte_compiler: GrammarCompiler) -> None:
    # `not` of a schema that is only annotations rejects everything; the annotation is reported.
    nothing = Grammar.from_json_schema({"not": {"format": "cidr", "maxLenght": 2}})
    with pytest.raises(GrammarDefinitionError, match="language is empty"):
        byte_compiler.compile(nothing)
    assert sorted(nothing.warnings) == [
        "ignored unknown format 'cidr' at /not/format: treated as an annotation",
        "ignored unknown keyword maxLenght at /not/maxLenght: treated as an annotation "
        "(did you mean 'maxLength'?)",
    ]
    not_string = byte_compiler.compile(
        Grammar.from_json_schema({"not": {"type": "string", "format": "cidr"}})
    )
    assert _accepts(not_string, "1") and not _accepts(not_string, '"10.0.0.0/8"')
    # allOf of a known and an unknown format is the known one.
    merged = Grammar.from_json_schema({"allOf": [{"type": "string", "format": "email"}, {"format": "cidr"}]})
    compiled = byte_compiler.compile(merged)
    assert _accepts(compiled, '"a@example.com"') and not _accepts(compiled, '"10.0.0.0/8"')
    assert merged.warnings == ("ignored unknown format 'cidr' at /format: treated as an annotation",)
    with pytest.raises(UnsupportedSchemaError, match="unknown format 'cidr'"):
        Grammar.from_json_schema(
            {"allOf": [{"format": "email"}, {"format": "cidr"}]}, unknown_formats="error"
        )
    # Two values of one unknown keyword merge (neither constrains anything).
    assert Grammar.from_json_schema({"allOf": [{"info": 1}, {"info": 2}]}).warnings == (
        "ignored unknown keyword info at /info: treated as an annotation",
    )
