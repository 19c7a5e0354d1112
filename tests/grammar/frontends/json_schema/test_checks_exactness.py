"""``oneOf``, ``not`` and ``allOf`` lowered to checks compiled to one automaton
(applicators/checks.py), against jsonschema.

These are the schemas no complement or merge can be written for (formats, ``multipleOf``, more than
eight overlapping branches, two ``contains``, anyOf products past 64): each must compile in strict mode to a grammar holding a check, agree with
jsonschema on every candidate (up to the documented false negatives: member order, ``3.0`` for an
integer, escaped ASCII in constrained strings), keep no prefix that no accepted value completes,
and have exact masks over the DeepSeek-V4 vocabulary along accepted documents.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import pytest
from grammar_support import assert_mask_exact, hf_tokenizer, tokenizer_info

from agent_infer.errors import GrammarLimitError, UnsupportedSchemaError
from agent_infer.grammar import Grammar, GrammarCompiler, GrammarMatcher, TokenizerInfo
from agent_infer.grammar.ir import Check

FORMATS = jsonschema.FormatChecker()

CHECKED: list[Any] = [
    # Multiples of 3 or of 5, not of both (the residue automata overlap on multiples of 15).
    {"oneOf": [{"type": "integer", "multipleOf": 3}, {"type": "integer", "multipleOf": 5}]},
    # A dotted quad may start with 1: exactly one holds.
    {"type": "string", "oneOf": [{"format": "ipv4"}, {"pattern": "^1"}]},
    # A format against a pattern, no type: every non-string is in both, so only strings pass.
    {"oneOf": [{"format": "uuid"}, {"pattern": "^x"}]},
    # Nine overlapping branches (past the complements' bound of eight).
    {"type": "object", "oneOf": [{"required": [f"k{i}"]} for i in range(9)]},
    # Objects that declare members in different orders, one requiring an undeclared name.
    {
        "type": "object",
        "oneOf": [
            {
                "properties": {"b": {"type": "string"}, "a": {"type": "integer", "multipleOf": 2}},
                "required": ["a"],
            },
            {"properties": {"a": {"type": "integer", "multipleOf": 3}}, "required": ["c"]},
        ],
    },
    # not, with an exact format inside: strings under 8 characters that are no dotted quad.
    {"type": "string", "maxLength": 8, "not": {"format": "ipv4"}},
    # allOf of two contains (no keyword merge joins them): both must hold.
    {"type": "array", "allOf": [{"contains": {"const": 1}}, {"contains": {"const": 2}}]},
    # allOf of anyOf products past 64 combinations: decided together instead of multiplied out.
    {
        "type": "integer",
        "allOf": [
            {"anyOf": [{"minimum": 10 * i, "maximum": 10 * i + 5} for i in range(9)]},
            {"anyOf": [{"multipleOf": k} for k in range(2, 11)]},
        ],
    },
    # oneOf of items and contains: the complement of items is a contains, which no merge joins
    # with the other one (an allOf check inside the complemented branch).
    {"oneOf": [{"type": "array", "items": {"type": "integer"}}, {"type": "array", "contains": {"const": 1}}]},
    # A free number (an additional member) judged by an integer grammar and the other way round:
    # both written in canonical spellings (no exponent, no fraction ending in 0).
    {
        "type": "object",
        "oneOf": [
            {"properties": {"a": {"type": "integer", "multipleOf": 2}}},
            {"properties": {"b": {"type": "integer"}}, "required": ["b"]},
        ],
    },
    # Multiples of 3, or numbers from 0 to 100: the residue automaton judges fractions.
    {"oneOf": [{"type": "integer", "multipleOf": 3}, {"type": "number", "minimum": 0, "maximum": 100}]},
    # Anything, or a multiple of 0.5 from -2 to 4: exactly one holds outside those multiples.
    {"oneOf": [True, {"type": "number", "multipleOf": 0.5, "minimum": -2, "maximum": 4}]},
    # Pattern properties against a declared name they match: all the schemas that may apply to a
    # member are aligned together.
    {
        "type": "object",
        "oneOf": [
            {"patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": False},
            {"properties": {"x1": {"type": "integer", "multipleOf": 2}}, "required": ["x1"]},
        ],
    },
    # A name two patterns of one item match (its value is judged under both) against a pattern.
    {
        "type": "object",
        "oneOf": [
            {"patternProperties": {"a": {"type": "string"}, "^b": {"maxLength": 2}}},
            {"properties": {"ba": {"type": "string", "pattern": "^x"}}, "required": ["ba"]},
        ],
    },
    # not of pattern properties (multiples of 3 under names starting with n).
    {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "not": {"patternProperties": {"^n": {"multipleOf": 3}}},
    },
    # Property names against a declared name (keys read by automata in both items).
    {
        "type": "object",
        "oneOf": [
            {"propertyNames": {"pattern": "^a"}},
            {"properties": {"ab": {"type": "integer", "multipleOf": 2}}, "required": ["ab"]},
        ],
    },
    # A dependency against a declared name: its names are declared in the union order too.
    {
        "type": "object",
        "oneOf": [
            {"dependentRequired": {"a": ["b"]}},
            {"properties": {"a": {"type": "integer", "multipleOf": 3}}, "required": ["a"]},
        ],
    },
    # Two branches every non-object satisfies: null and booleans are in both, so only objects
    # one of them rejects pass (a group that stands twice counts twice).
    {
        "oneOf": [
            {"patternProperties": {"^n": {"type": "string", "pattern": "^.$"}}},
            {},
            {"enum": ["x", None]},
        ]
    },
    # Nested not: neither level has a written complement (multipleOf), so the negated item is
    # itself a check: odd numbers or multiples of 3.
    {"type": "integer", "not": {"multipleOf": 2, "not": {"multipleOf": 3}}},
    # A large allOf product: four anyOf parts, 486 combinations, decided in one automaton.
    {
        "type": "integer",
        "allOf": [
            {"anyOf": [{"minimum": 10 * i, "maximum": 10 * i + 5} for i in range(9)]},
            {"anyOf": [{"multipleOf": k} for k in range(2, 11)]},
            {"anyOf": [{"not": {"multipleOf": k}} for k in (4, 6, 9)]},
            {"anyOf": [{"maximum": 40}, {"minimum": 60}]},
        ],
    },
    # not of a oneOf that itself needs a check, under an array.
    {
        "type": "array",
        "items": {
            "type": "integer",
            "not": {"oneOf": [{"type": "integer", "multipleOf": 2}, {"type": "integer", "multipleOf": 3}]},
        },
    },
]

CANDIDATES: list[Any] = [
    *(0, 1, 2, 3, 4, 5, 6, 9, 10, 12, 15, 30, -3, -5, 7, 1.5, True, False, None, 11, 13, 37, 80, 83, 85),
    *(8, 14, 18, 24, 33, 36, 42, 44, 63, 64, 65, 72),
    *(0.25, -2.5, 3.5, 4.5, 1e21, -0.0, 2.0, {"a": 2.0, "b": 1}, {"a": 1.5, "b": 2}, {"a": 4, "b": 1.5}),
    *(
        "",
        "x",
        "xa",
        "ab",
        "a@b.c",
        "q@r",
        "1.2.3.4",
        "10.0.0.1",
        "10.0.0.256",
        "12",
        "300.1.1.1",
        "1.1.1.01",
    ),
    *("123e4567-e89b-12d3-a456-426614174000", "xyz", "x1", "ABCDEF"),
    *({}, {"a": 2}, {"a": 3}, {"a": 6}, {"c": 1}, {"a": 2, "c": 1}, {"a": 3, "c": 1}, {"b": "s", "a": 2}),
    *({"a": 4, "b": "s", "c": 1}, {"k0": 1}, {"k0": 1, "k3": 2}, {"k8": []}, {"k2": {"k3": 1}}, {"z": 1}),
    *(
        [],
        [1],
        [2],
        [6],
        [1, 5],
        [1, 6],
        [7, 11, 13],
        [3],
        [1, 2],
        [2, 3, 1],
        [2, 2],
        ["a", 1],
        [1.5, 1],
        [None],
    ),
    *({"a1": 0}, {"b2": 0}, {"a1": 0, "b2": 0}, {"b8": 1, "a0": [1]}, {"a3": 1, "a4": 2}),
    *({"x1": 2}, {"x1": 3}, {"x2": 1}, {"x1": 2, "y": 1}, {"x1": 4, "x2": "s"}, {"ba": "xy"}, {"ba": "xyz"}),
    *({"ba": "y"}, {"ab": "s"}, {"ab": 1}, {"n": 3}, {"n": 4}, {"n": 4, "n2": 6}, {"n": 4, "n2": 5}),
    *(
        {"n": "s"},
        {"n": "st"},
        {"nn": None},
        {"ab": 2, "b": 1},
        {"a": 3, "b": 1},
        {"a": 4, "b": 1},
        {"a": "x"},
    ),
]


def _accepts(compiled: Any, text: str) -> bool:
    m = GrammarMatcher(compiled)
    return m.accept_string(text) and m.can_terminate()


def _integral(v: Any) -> Any:
    """``v`` with integral floats as ints (``2.0`` is 2 to JSON Schema; an exponent-free spelling)."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, dict):
        return {k: _integral(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_integral(x) for x in v]
    return v


def _spellings(v: Any) -> list[str]:
    """Texts of ``v`` under the documented false negatives (members in any order, integers
    written without a fraction or an exponent)."""
    v = _integral(v)
    if isinstance(v, dict):
        return [json.dumps(dict(p), separators=(",", ":")) for p in itertools.permutations(v.items())]
    return [json.dumps(v, separators=(",", ":"))]


@pytest.fixture(scope="module")
def byte_compiler() -> GrammarCompiler:
    return GrammarCompiler(TokenizerInfo.bytes_only(), cache_enabled=False)


@pytest.mark.parametrize("schema", CHECKED, ids=lambda s: json.dumps(s)[:70])
def test_checks_agree_with_jsonschema(schema: Any, byte_compiler: GrammarCompiler) -> None:
    grammar = Grammar.from_json_schema(schema, whitespace="compact")
    assert any(isinstance(body, Check) for _, body in grammar.rules), "lowered without a check"
    compiled = byte_compiler.compile(grammar)
    oracle = jsonschema.Draft202012Validator(schema, format_checker=FORMATS)
    wrong: list[str] = []
    for inst in CANDIDATES:
        text = json.dumps(inst, separators=(",", ":"))
        got, valid = _accepts(compiled, text), oracle.is_valid(inst)
        if got and not valid:
            wrong.append(f"accepts invalid {text}")
        elif valid and not got and not any(_accepts(compiled, t) for t in _spellings(inst)):
            wrong.append(f"rejects valid {text}")
    assert not wrong, wrong


@pytest.mark.parametrize("schema", CHECKED, ids=lambda s: json.dumps(s)[:70])
def test_kept_prefixes_complete(schema: Any, byte_compiler: GrammarCompiler) -> None:
    """Every prefix of a candidate the matcher keeps has a completion it accepts, which jsonschema
    accepts too: no dead prefix (the product automaton drops them)."""
    compiled = byte_compiler.compile(Grammar.from_json_schema(schema, whitespace="compact"))
    oracle = jsonschema.Draft202012Validator(schema, format_checker=FORMATS)
    for inst in CANDIDATES:
        text = json.dumps(inst, separators=(",", ":"))
        for cut in range(len(text) + 1):
            m = GrammarMatcher(compiled)
            if not m.accept_string(text[:cut]):
                break
            rest = m.shortest_completion()
            assert rest is not None, text[:cut]
            whole = text[:cut] + rest.decode()
            assert _accepts(compiled, whole), whole
            assert oracle.is_valid(json.loads(whole)), whole


def test_flexible_and_indent_layouts_accept_no_invalid(byte_compiler: GrammarCompiler) -> None:
    for schema in CHECKED[:3]:
        oracle = jsonschema.Draft202012Validator(schema, format_checker=FORMATS)
        for options in ({"whitespace": "flexible"}, {"indent": 2}):
            compiled = byte_compiler.compile(Grammar.from_json_schema(schema, **options))
            for inst in CANDIDATES:
                text = json.dumps(inst, indent=2 if "indent" in options else None)
                if _accepts(compiled, text):
                    assert oracle.is_valid(inst), (schema, options, inst)


@pytest.mark.parametrize(
    ("schema", "doc"),
    [
        (CHECKED[1], "10.0.0.256"),
        (CHECKED[3], {"k4": {"k0": [1, 2]}, "z": "s"}),
        (CHECKED[4], {"b": "ok", "a": 4}),
    ],
)
def test_masks_exact_on_a_real_vocabulary(schema: Any, doc: Any) -> None:
    compiled = GrammarCompiler(tokenizer_info("deepseek")).compile(
        Grammar.from_json_schema(schema, whitespace="compact")
    )
    ids = (
        hf_tokenizer("deepseek").encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False).ids
    )
    m = GrammarMatcher(compiled)
    for pos, tid in enumerate(ids):
        assert_mask_exact(m, pos)
        assert m.accept_token(tid), pos
    assert_mask_exact(m, len(ids))
    assert m.can_terminate()


@pytest.mark.parametrize(
    ("schema", "options"),
    [
        # Numbers under float64 limits: a residue automaton keeps every digit, an integer 20, so
        # neither judges the other's texts.
        (
            {
                "type": "object",
                "oneOf": [
                    {"properties": {"a": {"type": "integer", "multipleOf": 2}}},
                    {"properties": {"b": {"type": "integer"}}, "required": ["b"]},
                ],
            },
            {"numbers": "float64"},
        ),
        # An approximated format judging strings it did not write (validators differ on emails).
        ({"type": "string", "not": {"format": "email"}}, {}),
        # A recursive branch: no automaton of it.
        (
            {
                "$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
                "oneOf": [
                    {"$ref": "#/$defs/t"},
                    {"type": "array", "maxItems": 2, "items": {"format": "email"}},
                ],
            },
            {},
        ),
        # Listed numbers read every exponent-free spelling of their values ("2.50"), which an
        # integer grammar misjudges.
        (
            {
                "type": "object",
                "oneOf": [
                    {"properties": {"a": {"enum": [2, 2.5]}}, "required": ["a"]},
                    {"properties": {"a": {"type": "integer", "multipleOf": 2}}, "required": ["a"]},
                ],
            },
            {},
        ),
        # A listed object of four members reads them in its own order only, another item writes
        # them in any order.
        (
            {
                "type": "object",
                "oneOf": [
                    {
                        "properties": {"x": {"enum": [{"a": 1, "b": 2, "c": 3, "d": 4}, "s"]}},
                        "required": ["x"],
                    },
                    {
                        "properties": {"x": {"type": ["object", "string"]}, "y": {"multipleOf": 3}},
                        "required": ["x"],
                    },
                ],
            },
            {},
        ),
    ],
)
def test_checks_that_cannot_be_exact_stay_refused(schema: Any, options: dict[str, Any]) -> None:
    with pytest.raises(UnsupportedSchemaError) as info:
        Grammar.from_json_schema(schema, **options)
    assert info.value.pointer is not None


def test_a_product_past_its_limit_is_a_limit_error_naming_the_rule() -> None:
    # 9 x 9 alternatives of required names: each item's branches die at their own names, and the
    # product follows every subset of them.
    schema = {
        "type": "object",
        "allOf": [
            {"anyOf": [{"required": [f"a{i}"]} for i in range(9)]},
            {"anyOf": [{"required": [f"b{i}"]} for i in range(9)]},
        ],
    }
    grammar = Grammar.from_json_schema(schema, whitespace="compact")
    with pytest.raises(GrammarLimitError, match="rule 'allOf' cannot be compiled to one automaton"):
        GrammarCompiler(TokenizerInfo.bytes_only(), cache_enabled=False).compile(grammar)
