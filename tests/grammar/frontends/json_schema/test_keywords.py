"""Lowering of each JSON Schema keyword family, checked with the reference recognizer."""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent_infer.errors import InvalidSchemaError, UnsupportedSchemaError
from agent_infer.grammar.frontends.json_schema import json_schema_to_grammar
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer


def _text(x: Any) -> str:
    return x if isinstance(x, str) else json.dumps(x, separators=(",", ":"), ensure_ascii=False)


def check(schema: Any, good: list[Any], bad: list[Any], **kw: Any) -> None:
    """Every ``good`` text/value is accepted and every ``bad`` one rejected."""
    rec = ReferenceRecognizer(json_schema_to_grammar(schema, **kw))
    for x in good:
        assert rec.accepts(_text(x)), f"rejected valid {_text(x)!r}"
    for x in bad:
        assert not rec.accepts(_text(x)), f"accepted invalid {_text(x)!r}"


def test_types_and_integer_policy() -> None:
    check({"type": ["null", "boolean"]}, [None, True, False], [0, '"x"'])
    check({"type": "integer"}, ["0", "-12", "7"], ["1.0", "1e2", "01", "-"])
    check({"type": "number"}, ["0", "-1.5", "1e-3", "2E+10"], ["01", ".5", "1.", "NaN"])
    check(True, [1, '"x"', [], {}], [])
    check(False, [], [1, None])


def test_number_bounds_are_exact_at_the_boundaries() -> None:
    check(
        {"type": "number", "minimum": 1.5, "exclusiveMaximum": 3},
        ["1.5", "1.50", "2", "2.999", "1.51"],
        ["1.49", "3", "3.0", "-2", "1e0"],
    )
    check(
        {"type": "integer", "minimum": -10, "maximum": 25},
        ["-10", "0", "-0", "25", "9"],
        ["-11", "26", "100"],
    )
    check({"type": "number", "exclusiveMinimum": 0}, ["0.001", "5"], ["0", "0.000", "-0.1"])


def test_multiple_of() -> None:
    check({"type": "integer", "multipleOf": 7}, ["0", "14", "-21", "700"], ["1", "15", "-22"])
    check({"type": "integer", "multipleOf": 5, "minimum": 0}, ["0", "5", "100"], ["-5", "3"])
    check({"type": "number", "multipleOf": 0.01}, ["1.25", "3", "0.10"], ["1.255"])
    check(
        {"type": "integer", "multipleOf": 3, "minimum": 2, "maximum": 10}, ["3", "6", "9"], ["0", "12", "4"]
    )


def test_string_lengths_count_escapes_as_one_character() -> None:
    schema = {"type": "string", "minLength": 2, "maxLength": 3}
    check(
        schema, ['"ab"', '"a\\n"', '"\\u00e9\\"x"', '"💩💩"', '"\\ud83d\\ude00a"'], ['"a"', '"abcd"', '"\\n"']
    )
    check({"type": "string"}, ['"\\/\\b\\f\\r\\t"', '"\\u0041"'], ['"\n"', '"\\x"', '"\\ud800"', '"a'])


def test_pattern_is_an_unanchored_search() -> None:
    check({"type": "string", "pattern": "[0-9]{3}"}, ['"ab123cd"', '"999"'], ['"12"', '"a1b2c3"'])
    check({"type": "string", "pattern": "^a.*z$"}, ['"az"', '"a-\\"-z"'], ['"za"', '" az"'])


def test_pattern_intersected_with_lengths() -> None:
    check(
        {"type": "string", "pattern": "^[a-z]+$", "minLength": 2, "maxLength": 4},
        ['"ab"', '"abcd"'],
        ['"a"', '"abcde"', '"aB"'],
    )
    check(
        {"allOf": [{"pattern": "a"}, {"pattern": "b"}], "type": "string"}, ['"ab"', '"xbya"'], ['"aa"', '"b"']
    )


@pytest.mark.parametrize(
    ("fmt", "good", "bad"),
    [
        (
            "date",
            ["2024-02-29", "2000-02-29", "2021-12-31"],
            ["2023-02-29", "1900-02-29", "2021-04-31", "2021-13-01"],
        ),
        ("time", ["23:59:60Z", "12:00:00.5+05:30"], ["24:00:00Z", "12:00:00", "12:60:00Z"]),
        ("date-time", ["2020-01-01T00:00:00Z", "2020-01-01t00:00:00z"], ["2020-01-01 00:00:00Z"]),
        ("duration", ["P1Y2M", "PT5M", "P2W"], ["P", "PT", "P1W2D"]),
        ("email", ["a.b@example.com", "x@[127.0.0.1]"], ["a..b@example.com", "@x", "a@"]),
        # 253 characters at most; `--` third and fourth only in A-labels, which are refused.
        (
            "hostname",
            ["example.com", "a-b.c", "a--b.com", ".".join(["a" * 63] * 3 + ["a" * 61])],
            ["-a.com", "a_b.com", "xn--X", "xn--bck0j", "ab--c.com", ".".join(["a" * 63] * 4)],
        ),
        ("ipv4", ["127.0.0.1", "255.255.255.255"], ["256.0.0.1", "01.1.1.1", "1.1.1"]),
        ("ipv6", ["::1", "1:2:3:4:5:6:7:8", "::ffff:1.2.3.4"], ["1:2:3:4:5:6:7:8:9", "12345::"]),
        ("uuid", ["2eb8aa08-aa98-11ea-b4aa-73b441d16380"], ["2eb8aa08aa9811eab4aa73b441d16380"]),
        ("uri", ["https://example.com/a?b#c", "urn:isbn:1"], ["//example.com", "http://a b"]),
    ],
)
def test_formats_are_assertions(fmt: str, good: list[str], bad: list[str]) -> None:
    check({"type": "string", "format": fmt}, [json.dumps(g) for g in good], [json.dumps(b) for b in bad])


def test_hostname_keys_need_a_length_bound() -> None:
    """A key's hostname is bounded by a maxLength (its 253 total would multiply the key automaton)."""
    check(
        {"type": "object", "propertyNames": {"format": "hostname", "maxLength": 63}},
        ['{"a.b":1}', json.dumps({"a" * 63: 1})],
        [json.dumps({"a" * 64: 1}), '{"xn--abc":1}'],
    )
    with pytest.raises(UnsupportedSchemaError) as info:
        json_schema_to_grammar({"type": "object", "propertyNames": {"format": "hostname"}})
    assert info.value.pointer == "/propertyNames/format"


def test_object_declared_order_required_and_additional() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "null"}},
        "required": ["b"],
    }
    # Declared order, or the required members first (in `required` order): other orders are not
    # taken (a documented false negative).
    check(
        schema,
        [
            {"b": "x"},
            {"a": 1, "b": "x"},
            {"a": 1, "b": "x", "d": [None]},
            '{"b":"x","a":1}',
            '{"b":"x","a":1,"c":null}',
        ],
        [
            {"a": 1},
            {},
            '{"b":"x","a":"y"}',
            {"a": "1", "b": "x"},
            '{"c":null,"b":"x"}',
            '{"a":1,"c":null,"b":"x"}',
        ],
    )
    closed = {**schema, "additionalProperties": False}
    check(closed, [{"b": "x"}], [{"b": "x", "c": 1}])
    typed = {**schema, "additionalProperties": {"type": "boolean"}}
    check(typed, [{"b": "x", "z": True}], [{"b": "x", "z": 1}, '{"b":"x","b":true}'])


def test_pattern_properties_property_names_and_counts() -> None:
    check(
        {"type": "object", "patternProperties": {"^x-": {"type": "integer"}}, "additionalProperties": False},
        [{}, {"x-a": 1}],
        [{"x-a": "s"}, {"y": 1}],
    )
    check({"type": "object", "propertyNames": {"maxLength": 2}}, [{"ab": 1}], [{"abc": 1}])
    check(
        {"type": "object", "minProperties": 1, "maxProperties": 2},
        [{"a": 1}, {"a": 1, "b": 2}],
        [{}, {"a": 1, "b": 2, "c": 3}],
    )


def test_arrays() -> None:
    check(
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
        [[], [1], [1, "a"]],
        [[1, 2], [1, "a", 3], ["a"]],
    )
    check(
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
        [[1, 2], [1, 2, 3]],
        [[1], [1, 2, 3, 4], [1, "a"]],
    )
    check({"type": "array", "contains": {"const": 5}}, [[5], [1, 5, 2]], [[], [1, 2]])
    check({"type": "array", "items": [{"type": "integer"}], "additionalItems": False}, [[1]], [[1, 2]])


def test_enum_const_use_json_equality() -> None:
    check(
        {"enum": [1, "a", None, [1, 2], {"x": 1, "y": 2}]},
        ["1", "1.0", '"a"', "null", "[1,2]", '{"y":2,"x":1}'],
        ["2", '"b"', "[2,1]", "true"],
    )
    check({"const": 0}, ["0", "-0", "0.0"], ["false", "1"])
    check({"type": "string", "enum": ["a", 1, "b"], "maxLength": 0}, [], ['"a"', "1"])


def test_any_of_one_of_all_of_not() -> None:
    check({"anyOf": [{"type": "integer", "minimum": 3}, {"type": "null"}]}, ["3", "null"], ["2", '"x"'])
    check({"oneOf": [{"type": "string"}, {"type": "integer"}]}, ['"x"', "1"], ["null"])
    check(
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"a": {"minimum": 5}}},
            ]
        },
        [{"a": 5}],
        [{"a": 4}, {}],
    )
    check({"not": {"type": ["string", "null"]}}, ["1", "[]"], ['"x"', "null"])
    check(
        {
            "type": "object",
            "properties": {"k": {"type": "string"}},
            "anyOf": [{"required": ["k"]}, {"maxProperties": 0}],
        },
        [{}, {"k": "v"}],
        [{"j": 1}],
    )


def test_refs_recursion_anchors_and_ids() -> None:
    node = {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer"},
                    "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]},
                },
                "required": ["v", "next"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/node",
    }
    check(
        node,
        [{"v": 1, "next": {"v": 2, "next": None}}],
        [{"v": 1}, {"v": 1, "next": {"v": "x", "next": None}}],
    )
    check({"$defs": {"a": {"$anchor": "num", "type": "integer"}}, "$ref": "#num"}, ["1"], ['"x"'])
    check(
        {
            "$id": "https://example.com/root.json",
            "$defs": {"b": {"$id": "b.json", "type": "boolean"}},
            "items": {"$ref": "b.json"},
            "type": "array",
        },
        [[True]],
        [[1]],
    )
    check(
        {"properties": {"a": {"type": "integer"}, "b": {"$ref": "#/properties/a"}}}, [{"b": 1}], [{"b": "x"}]
    )
    check(
        {"$ref": "http://r.example/x.json"},
        ["1"],
        ['"s"'],
        remotes={"http://r.example/x.json": {"type": "integer"}},
    )


def test_refs_into_unread_keywords_and_draft_04_ids() -> None:
    # A reference into a keyword the front end does not read (hyper-schema ``links``, a
    # document-level ``defs``) reaches a schema whose own references are relative.
    check(
        {
            "defs": {"n": {"type": "integer"}, "pair": {"type": "array", "items": {"$ref": "#/defs/n"}}},
            "links": [{"schema": {"type": "string"}}],
            "properties": {"p": {"$ref": "#/defs/pair"}, "l": {"$ref": "#/links/0/schema"}},
        },
        [{"p": [1, 2], "l": "x"}],
        [{"p": ["x"]}, {"l": 1}],
    )
    # Draft 4 names a schema, or an anchor ("#name"), with a plain ``id``; later drafts do not.
    draft4 = {
        "$schema": "http://json-schema.org/draft-04/schema#",
        "definitions": {"n": {"id": "#num", "type": "integer"}, "b": {"id": "b.json", "type": "boolean"}},
        "properties": {"a": {"$ref": "#num"}, "b": {"$ref": "b.json"}},
    }
    check(draft4, [{"a": 1, "b": True}], [{"a": "x"}, {"b": 1}])
    with pytest.raises(InvalidSchemaError, match="anchor 'num' is not defined"):
        json_schema_to_grammar({**draft4, "$schema": "http://json-schema.org/draft-07/schema#"})


def test_whitespace_modes() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}}}
    value = {"a": [1, 2]}
    check(schema, [value, json.dumps(value, indent=2), '{ "a" :[1 ,2] }'], ['{   "a":[1]}'])
    check(schema, [value], [json.dumps(value)], whitespace="compact")
    check(schema, [json.dumps(value, indent=2), "{}"], [value], indent=2)


def test_dependencies_split_into_disjoint_cases() -> None:
    check({"type": "object", "dependentRequired": {"a": ["b"]}}, [{}, {"b": 1}, {"a": 1, "b": 2}], [{"a": 1}])
    check(
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "dependentSchemas": {"a": {"properties": {"b": {"type": "string"}}, "required": ["b"]}},
        },
        [{}, {"a": 1, "b": "x"}, {"b": 1}],
        [{"a": 1}, {"a": 1, "b": 2}],
    )


def test_enum_filtered_by_keywords_a_grammar_cannot_express() -> None:
    check(
        {"enum": [1, 2, 3, "x"], "not": {"enum": [2]}, "oneOf": [{"type": "integer"}, {"const": 3}]},
        ["1"],
        ["2", "3", '"x"'],
    )
    check({"enum": [[1, 1], [1, 2]], "uniqueItems": True}, ["[1,2]"], ["[1,1]"])


def test_complements_for_not_if_then_else_and_overlapping_one_of() -> None:
    check({"not": {"minimum": 3}}, ["2.5", "-1"], ["3", "4", '"x"', "null"])
    check({"type": "string", "not": {"enum": ["a", "b"]}}, ['"c"', '"ab"', '""'], ['"a"', '"b"'])
    check({"type": "string", "not": {"pattern": "^x"}}, ['"ax"'], ['"xa"'])
    check(
        {
            "if": {"properties": {"k": {"const": "n"}}, "required": ["k"]},
            "then": {"properties": {"v": {"type": "integer"}}},
            "else": {"properties": {"v": {"type": "string"}}},
        },
        [{"k": "n", "v": 1}, {"k": "s", "v": "x"}, {"v": "x"}],
        [{"k": "n", "v": "x"}, {"k": "s", "v": 1}],
    )
    check({"oneOf": [{"type": "integer"}, {"minimum": 2}]}, ["1", "2.5", '"x"'], ["2", "3"])
    check(
        {"oneOf": [{"required": ["a"]}, {"required": ["b"]}], "type": "object"},
        [{"a": 1}, {"b": 1}],
        [{}, {"a": 1, "b": 2}],
    )
    check(
        {"type": "number", "not": {"type": "integer"}, "minimum": 1, "maximum": 2}, ["1.5"], ["1", "2", "0.5"]
    )


def test_one_of_over_groups_of_enums() -> None:
    """oneOf branches that are enums or oneOfs of enums are told apart by their values (a branch
    accepts nothing outside them), and only shared values go through a branch's grammar: a value
    valid under two branches is rejected, one whose second listing the type excludes is not."""
    group = {"oneOf": [{"type": "string", "enum": ["a", "b"]}, {"type": "string", "enum": ["c"]}]}
    disjoint = {"oneOf": [group, {"type": "string", "enum": ["d", "e"]}]}
    rec = ReferenceRecognizer(json_schema_to_grammar(disjoint, whitespace="compact"))
    for v in "abcde":
        assert rec.accepts(json.dumps(v)), v
    assert not rec.accepts('"f"')
    overlapping = {
        "oneOf": [{"enum": ["a", "b", "c"]}, {"type": "string", "enum": ["c", "d", 1]}, {"enum": [1.0, 2]}]
    }
    rec = ReferenceRecognizer(json_schema_to_grammar(overlapping, whitespace="compact"))
    for v in ('"a"', '"b"', '"d"', "2", "1", "1.0"):
        assert rec.accepts(v), v
    for v in ('"c"', '"e"', "3"):
        assert not rec.accepts(v), v


def test_pattern_properties_that_repeat_additional_properties() -> None:
    """Regions whose value schema is additionalProperties' own merge into one (no automaton per
    pattern); the language is unchanged and a bad pattern is still reported."""
    from agent_infer.errors import InvalidSchemaError

    check(
        {"type": "object", "patternProperties": {"^.{1,3}$": {}}},
        [{}, {"": 1}, {"abcdef": [1]}, {"ab": "x", "abcd": None}],
        [[], '{"a"}'],
    )
    check(
        {
            "type": "object",
            "patternProperties": {"^a": {"type": "integer"}},
            "additionalProperties": {"type": "integer"},
        },
        [{"a": 1, "b": 2}, {}],
        [{"a": "x"}, {"b": "x"}],
    )
    with pytest.raises(InvalidSchemaError):
        json_schema_to_grammar({"type": "object", "patternProperties": {"(": {}}})


def test_long_enum_next_to_an_unknown_keyword() -> None:
    """Thousands of codes beside ``type`` and a tool's own keyword: each value is checked against
    the type once the schema-wide work is done, and values of another type are dropped."""
    codes = [f"{i:04d}" for i in range(3000)]
    check(
        {"type": "string", "x-kind": "code", "enum": [*codes, 5, None, ["0001"]]},
        ['"0007"', '"2999"'],
        [5, None, ["0001"], '"3000"', '"7"'],
    )


def test_enum_next_to_unknown_keywords_without_a_type() -> None:
    """A tool's own keyword and no ``type``: every enum value is kept (the keyword is an
    annotation), the warning is recorded once, and a typo of a real keyword fails only where
    unknown keywords are asked to."""
    from agent_infer.errors import UnsupportedSchemaError
    from agent_infer.grammar.frontends.json_schema import json_schema_to_grammar

    schema = {"enum": ["a", 1, None, {"k": [1]}], "options": {"enum_titles": ["A", "One", "None", "Obj"]}}
    check(schema, ['"a"', 1, None, {"k": [1]}], ['"b"', 2, {"k": []}])
    warnings = json_schema_to_grammar(schema).warnings
    assert sum("options" in w for w in warnings) == 1, warnings
    with pytest.raises(UnsupportedSchemaError, match="maxLenght"):
        json_schema_to_grammar({"enum": ["a"], "maxLenght": 3}, unknown_keywords="error")


def test_number_enum_listed_in_one_pass_keeps_every_numeral() -> None:
    """An enum of numbers is built in one pass (``listed_numbers``): the same JSON texts as one
    exact value expression per member (``value_expr``), trailing zeros, ``-0`` and a float too
    large for a short decimal included."""
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler
    from agent_infer.grammar.frontends.json_schema.types import numerals as num
    from agent_infer.grammar.frontends.json_schema.values.canon import to_fraction
    from agent_infer.grammar.frontends.json_schema.values.enums import value_expr
    from agent_infer.grammar.ir import alt
    from agent_infer.grammar.ir.grammar import Grammar

    values: list[Any] = [0, 100, 101, 226, 499, -3, 2.5, 0.1, -0.25, 1e22, 1.5e-7]
    c = Compiler.__new__(Compiler)
    old = alt(*(value_expr(c, v, 0) for v in values))
    new = num.listed_numbers([to_fraction(v) for v in values], [json.dumps(v) for v in values])
    ref_old = ReferenceRecognizer(Grammar.from_expr(old))
    ref_new = ReferenceRecognizer(Grammar.from_expr(new))
    texts = [json.dumps(v) for v in values] + [
        f"{s}{i}{t}"
        for s in ("", "-")
        for i in ("0", "100", "226", "3", "2", "00")
        for t in ("", ".0", ".00", ".5", ".50", "e2")
    ]
    texts += ["0.10", ".1", "1.5e-7", "0.00000015", "10000000000000000000000", "1e+22", "-0.250", "2.50"]
    for t in texts:
        assert ref_old.accepts(t) == ref_new.accepts(t), t
    check({"enum": [0, 100, 2.5, "x", None]}, [0, -0.0, 100, 100.0, 2.5, '"x"', None], [1, 2.4, '"y"', False])


def test_enumerated_multiples_keep_every_numeral_of_each_value() -> None:
    """Bounded ``multipleOf`` lists its values (``exact_numerals``): the same numerals as one exact
    interval per value (``bounded_number``), signs, zero's ``-0`` and trailing zeros included."""
    from fractions import Fraction

    from agent_infer.grammar.frontends.json_schema.types import numerals as num
    from agent_infer.grammar.ir import alt
    from agent_infer.grammar.ir.grammar import Grammar

    texts = [
        *(
            f"{s}{i}{t}"
            for s in ("", "-")
            for i in ("0", "1", "3", "16", "32", "48", "2032", "016", "")
            for t in ("", ".", ".0", ".00", ".5", ".50", ".25", ".250", ".05", "e1")
        ),
        "1.2",
        "-1.2",
        "0.3",
        "00",
    ]
    cases = [
        ([Fraction(k * 16) for k in range(-127, 127)], True),
        ([Fraction(k * 16) for k in range(-3, 4)], False),
        ([Fraction(k, 4) for k in range(-9, 10)], False),
        ([Fraction(k, 3) for k in range(-4, 5)], False),  # thirds: only the integers are decimals
        ([Fraction(1, 20), Fraction(-1, 2)], False),
        ([Fraction(0)], True),
    ]
    for values, integer in cases:
        old = alt(*(e for v in values if (e := num.bounded_number(v, False, v, False, integer)) is not None))
        new = num.exact_numerals(values, integer)
        ref_old = ReferenceRecognizer(Grammar.from_expr(old))
        ref_new = ReferenceRecognizer(Grammar.from_expr(new))
        for t in texts:
            assert ref_old.accepts(t) == ref_new.accepts(t), (values[:3], integer, t)
    check(
        {"type": "integer", "minimum": -2032, "maximum": 2031, "multipleOf": 16},
        ["-2032", "0", "-0", "2016"],
        ["8", "2032", "16.0"],
    )
    check(
        {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25},
        ["-0.75", "0.50", "1", "1.0", "-0"],
        ["0.3", "1.25"],
    )
