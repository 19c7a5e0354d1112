"""Front-end shortcuts that must give exactly what the long way gives: the layered length-bound
product, enum filtering next to unknown keywords, object tails, process-wide format constants."""

from __future__ import annotations

import pytest

from agent_infer.errors import GrammarLimitError, UnsupportedSchemaError
from agent_infer.grammar import Grammar, clear_grammar_caches
from agent_infer.grammar.automata import (
    dfa_bound_length,
    dfa_complement,
    dfa_intersect,
    expr_to_dfa,
    names_dfa,
)
from agent_infer.grammar.frontends.ebnf.gbnf import referenced_rules
from agent_infer.grammar.frontends.json_schema.types.automaton_rules import dfa_to_rules
from agent_infer.grammar.frontends.json_schema.types.lengths import bounded_rules
from agent_infer.grammar.frontends.regex.search import regex_search_expr
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer

PATTERNS = [
    r"^([a-z0-9-]+):([a-z0-9\.-]+):([a-z0-9-]+)?:([a-z0-9-]+)$",
    r"ab",
    r"^(a|bb)+$",
    r"[^/]",
    r"^\d{3}$",
]


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize(("lo", "hi"), [(0, 0), (0, 1), (0, 9), (2, 9), (4, 4), (3, 40), (6, 2)])
def test_bounded_rules_equal_the_product_rules(pattern: str, lo: int, hi: int) -> None:
    # Same rules, names and order as the product automaton's rules, also on complements (their
    # gap edges are not merged by construction) and on intersections.
    dfa = expr_to_dfa(regex_search_expr(pattern, dialect="ecma"))
    others = [dfa_complement(dfa), dfa_intersect(dfa, dfa_complement(names_dfa(["ab", "a:b::c"])))]
    for a in (dfa, *others):
        assert bounded_rules(a, lo, hi, "p-") == dfa_to_rules(dfa_bound_length(a, lo, hi), "p-")


def test_bounded_rules_state_limit() -> None:
    a = expr_to_dfa(regex_search_expr(r"^([a-z]+):([a-z]+):([a-z]+)$", dialect="ecma"))
    with pytest.raises(GrammarLimitError) as want:
        dfa_bound_length(a, 0, 700, max_states=1500)
    with pytest.raises(GrammarLimitError) as got:
        bounded_rules(a, 0, 700, "p-", max_states=1500)
    assert str(got.value) == str(want.value)


def test_bounded_string_schema_accepts_exactly_the_bound() -> None:
    schema = {"type": "string", "pattern": r"^[a-z]+:[a-z]+$", "minLength": 4, "maxLength": 6}
    grammar = Grammar.from_json_schema(schema)
    rec = ReferenceRecognizer(grammar)
    for text, ok in [("ab:c", True), ("a:b", False), ("abc:de", True), ("abc:def", False), ("abcd", False)]:
        assert rec.accepts(f'"{text}"') is ok, text


def test_enum_next_to_unknown_keyword() -> None:
    # The unknown keyword is an annotation: the type alone filters the values; the warning is
    # the one the keyword gets where it stands, once.
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "enum": ["a", 1, "b", None], "pbj": {"rule": "single"}},
            "t": {"type": "string", "enum": ["a", 2], "pbj": {"rule": "single"}},
        },
    }
    grammar = Grammar.from_json_schema(schema, strict=False)
    assert grammar.warnings == (
        "ignored unknown keyword pbj at /properties/s/pbj: treated as an annotation",
        "ignored unknown keyword pbj at /properties/t/pbj: treated as an annotation",
    )
    rec = ReferenceRecognizer(grammar)
    assert rec.accepts('{"s":"a","t":"a"}')
    assert not rec.accepts('{"s":1}')
    assert not rec.accepts('{"s":null}')
    assert not rec.accepts('{"t":2}')
    # A container value under such a schema is still decided by the schema's own grammar.
    nested = {"type": "array", "enum": [[1], "x", {"a": 1}], "pbj": 1}
    assert ReferenceRecognizer(Grammar.from_json_schema(nested, strict=False)).accepts("[1]")
    assert not ReferenceRecognizer(Grammar.from_json_schema(nested, strict=False)).accepts('"x"')


def test_enum_next_to_misspelled_keyword_warns_or_is_refused_on_request() -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "enum": ["a"], "patern": "x"}}}
    with pytest.raises(UnsupportedSchemaError) as err:
        Grammar.from_json_schema(schema, unknown_keywords="error")
    assert err.value.pointer == "/properties/s/patern"
    for strict in (True, False):
        grammar = Grammar.from_json_schema(schema, strict=strict)
        assert len(grammar.warnings) == 1 and "did you mean 'pattern'" in grammar.warnings[0]
        assert ReferenceRecognizer(grammar).accepts('{"s":"a"}')


def _reachable(grammar: Grammar) -> set[str]:
    return referenced_rules(grammar)


def test_object_tails_are_all_reachable() -> None:
    # Optional members after a required one: "nothing emitted yet" cannot happen there, so those
    # tails are not written (no path would reach them).
    props = {name: {"type": "object", "properties": {"x": {"type": "integer"}}} for name in "abcdefg"}
    schema = {"type": "object", "properties": props, "required": ["c"]}
    grammar = Grammar.from_json_schema(schema)
    assert _reachable(grammar) == {name for name, _ in grammar.rules}
    rec = ReferenceRecognizer(grammar)
    assert rec.accepts('{"c":{}}')
    assert rec.accepts('{"a":{},"c":{"x":1},"g":{}}')
    assert rec.accepts('{"b":{},"c":{},"d":{},"e":{},"f":{},"g":{}}')
    assert not rec.accepts('{"a":{}}')
    assert not rec.accepts('{"c":{},}')
    assert not rec.accepts("{}")


def test_formats_are_process_constants() -> None:
    # Built from the fixed format table: not memos of earlier schemas, so the cold switch keeps them.
    from agent_infer.grammar.frontends.json_schema.types import formats

    first = formats.encoded_format("date-time")
    clear_grammar_caches()
    assert formats.encoded_format("date-time") is first
    assert formats.format_expr("no-such-format") is None
    assert "no-such-format" not in formats._FORMAT_EXPRS


def _accepts(schema: object, texts: dict[str, bool]) -> None:
    rec = ReferenceRecognizer(Grammar.from_json_schema(schema))
    for text, ok in texts.items():
        assert rec.accepts(text) is ok, text


def test_one_pattern_key_region_without_an_automaton() -> None:
    # One patternProperties region and nothing else: the key is the pattern's search expression
    # (no Python DFA); a declared name that the pattern matches keeps its own schema.
    pattern = r"^[a-z]{2,3}(-[A-Z]{2})?$"
    schema = {
        "type": "object",
        "patternProperties": {pattern: {"type": "integer"}},
        "additionalProperties": False,
    }
    grammar = Grammar.from_json_schema(schema)
    assert not any(name.startswith("key-") for name, _ in grammar.rules), "the key was built from a DFA"
    _accepts(schema, {'{"en":1}': True, '{"en-GB":2,"fra":3}': True, '{"EN":1}': False, '{"en":"x"}': False})
    # The pattern is a search: an unanchored one takes any key containing a match.
    _accepts(
        {"patternProperties": {"b/c": {"type": "null"}}, "additionalProperties": False},
        {'{"ab/cd":null}': True, '{"ab\\/cd":null}': True, '{"abc":null}': False},
    )
    declared = {
        "type": "object",
        "properties": {"en": {"minimum": 0}, "Zz": {"type": "boolean"}},
        "patternProperties": {pattern: {"type": "integer"}},
        "additionalProperties": False,
    }
    # A declared name the pattern matches must satisfy both schemas; other matching keys only
    # the pattern's.
    _accepts(declared, {'{"en":1}': True, '{"en":-1}': False, '{"en":"x"}': False, '{"de":-1}': True})
    unrelated = {**declared, "properties": {"Zz": {"type": "boolean"}}}
    _accepts(unrelated, {'{"en":1}': True, '{"Zz":true}': True, '{"Zz":1}': False, '{"ZZ":1}': False})


def test_string_enum_filtered_by_lengths_without_a_recognizer() -> None:
    schema = {
        "enum": ["ab", "abcd", "a/b", "é", "日本語", 7, None, "abcdefg"],
        "minLength": 2,
        "maxLength": 4,
    }
    _accepts(
        schema,
        {
            '"ab"': True,
            '"abcd"': True,
            '"a/b"': True,
            '"a\\/b"': True,
            '"é"': False,
            '"日本語"': True,
            '"\\u65e5本語"': True,
            "7": True,  # lengths do not apply to numbers or null
            "null": True,
            '"abcdefg"': False,
        },
    )
    typed = {"type": "string", "enum": ["ab", "abc", 1], "minLength": 3}
    _accepts(typed, {'"abc"': True, '"ab"': False, "1": False})


def test_string_enum_encodings_keep_every_escape_form() -> None:
    values = ["a/b", 'q"uote', "tab\there", "ü-x", "plain"]
    grammar = Grammar.from_json_schema({"enum": values})
    rec = ReferenceRecognizer(grammar)
    import json

    for v in values:
        assert rec.accepts(json.dumps(v)), v
        assert rec.accepts(json.dumps(v, ensure_ascii=False)), v
    assert rec.accepts('"a\\/b"') and rec.accepts('"tab\\u0009here"') and rec.accepts('"\\u00fc-x"')
    assert not rec.accepts('"pl\\u0061in"')  # printable ASCII may not be escaped
    assert not rec.accepts('"plai"')


def test_format_under_lengths_reads_the_bound_off_the_format() -> None:
    # email implies 3+ code points and a date is 10: these bounds change nothing; a uuid is 36, so
    # minLength 40 leaves no string at all.
    _accepts(
        {"type": "string", "format": "email", "minLength": 3},
        {'"a@b.co"': True, '"ab"': False, '"a@"': False},
    )
    _accepts(
        {"type": "string", "format": "date", "maxLength": 255},
        {'"2024-02-29"': True, '"2024-2-29"': False},
    )
    uuid = {"type": "object", "properties": {"u": {"type": "string", "format": "uuid", "minLength": 40}}}
    _accepts(uuid, {"{}": True, '{"u":"123e4567-e89b-12d3-a456-426614174000"}': False})
    _accepts(
        {"type": "string", "format": "date-time", "maxLength": 20},
        {'"2024-02-29T10:00:00Z"': True, '"2024-02-29T10:00:00.5Z"': False},
    )


def _ref_chain(n: int) -> dict[str, object]:
    defs: dict[str, object] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "integer"}
    return defs


def test_reused_flattening_keeps_the_nesting_limit() -> None:
    # d0 is flattened once (a 60-level chain) and reused; reached again from 5 levels deeper it
    # exceeds the limit of 64 and must fail as it would without the reuse.
    defs = _ref_chain(60)
    ok = {
        "$defs": defs,
        "type": "object",
        "properties": {"x": {"$ref": "#/$defs/d0"}, "z": {"$ref": "#/$defs/d0"}},
    }
    _accepts(ok, {'{"x":1,"z":2}': True, '{"x":"1"}': False})
    deep: dict[str, object] = {"$ref": "#/$defs/d0"}
    for _ in range(5):
        deep = {"allOf": [deep]}
    bad = {**ok, "properties": {"x": {"$ref": "#/$defs/d0"}, "y": deep}}
    with pytest.raises(GrammarLimitError, match="nesting deeper than 64"):
        Grammar.from_json_schema(bad)


def test_reused_flattening_still_warns() -> None:
    # Non-strict: a flattening that warned is not kept, so the warning stands as without reuse
    # (once: it names the definition's own pointer).
    schema = {
        "$defs": {"a": {"allOf": [{"type": "object"}, {"$ref": "https://example.com/remote.json"}]}},
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/a"}, "q": {"$ref": "#/$defs/a"}},
    }
    grammar = Grammar.from_json_schema(schema, strict=False)
    assert [w.split(":")[0] for w in grammar.warnings] == ["ignored keyword $ref at /$defs/a/allOf/1/$ref"]


def test_lengths_implied_by_one_of_several_constraints_are_dropped() -> None:
    # The format implies minLength 3 and the pattern 8 (``https://``): either bounds the intersection.
    email = {"type": "string", "format": "email", "pattern": "^.*?@.*$", "minLength": 3}
    _accepts(email, {'"a@b.co"': True, '"ab.co"': False})
    prefixed = {"type": "string", "format": "uri", "pattern": "^https://", "minLength": 8}
    _accepts(prefixed, {'"https://a.b"': True, '"http://a.b"': False})
    # Not implied by any: the bound still applies.
    bounded = {"type": "string", "format": "email", "pattern": "@", "minLength": 7}
    _accepts(bounded, {'"ab@c.de"': True, '"a@b.co"': False})


def test_key_regions_exclude_only_the_names_they_hold() -> None:
    # "id" matches the pattern and "x-y" does not: the pattern region must exclude "id" and the
    # no-pattern region "x-y", each keeping its own schema; the no-pattern region is built
    # without a product with the names (no declared name there but "x-y").
    schema = {
        "type": "object",
        "properties": {"id": {}, "x-y": {"type": "string"}},
        "patternProperties": {"^[a-z]+$": {"type": "boolean"}},
        "additionalProperties": {"type": "integer"},
    }
    _accepts(
        schema,
        {
            '{"x-y":"s"}': True,
            '{"x-y":5}': False,
            '{"abc":true}': True,
            '{"abc":5}': False,
            '{"q-1":5}': True,
            '{"q-1":true}': False,
            '{"id":true}': True,
            '{"id":1}': False,
        },
    )
    # Names only inside the pattern: the no-pattern region holds none of them.
    inside = {
        "type": "object",
        "properties": {"id": {"type": "boolean"}},
        "patternProperties": {"^[a-z]+$": {"type": "boolean"}},
        "additionalProperties": {"type": "integer"},
    }
    _accepts(inside, {'{"id":true}': True, '{"id":3}': False, '{"A":3}': True, '{"A":true}': False})


def test_a_pattern_the_format_implies_is_dropped_without_changing_the_language() -> None:
    from agent_infer.grammar import Grammar
    from agent_infer.grammar.ir.recognizer import ReferenceRecognizer

    def rec(schema: dict[str, str]) -> ReferenceRecognizer:
        return ReferenceRecognizer(Grammar.from_json_schema({"type": "string", **schema}))

    both = rec({"format": "email", "pattern": "^.*@.*$"})
    alone = rec({"format": "email"})
    narrowed = rec({"format": "email", "pattern": "^a"})
    for text in ['"a@b.co"', '"ab.co"', '"x@y"', '"a b@c.d"', '"@b.co"', '"b@a.org"']:
        assert both.accepts(text) == alone.accepts(text), text
    assert both.accepts('"a@b.co"') and not both.accepts('"ab.co"')
    assert narrowed.accepts('"a@b.co"') and not narrowed.accepts('"b@a.org"')
