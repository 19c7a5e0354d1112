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
    *(0, 1, 2, 3, 4, 5, 6, 9, 10, 12, 15, 30, -3, -5, 7, 1.5, True, None, 11, 13, 37, 80, 83, 85),
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
    *([], [1], [2], [6], [1, 5], [1, 6], [7, 11, 13], [3], [1, 2], [2, 3, 1], [2, 2], ["a", 1], [1.5, 1], [None]),
    *({"a1": 0}, {"b2": 0}, {"a1": 0, "b2": 0}, {"b8": 1, "a0": [1]}, {"a3": 1, "a4": 2}),
]


def _accepts(compiled: Any, text: str) -> bool:
    m = GrammarMatcher(compiled)
    return m.accept_string(text) and m.can_terminate()


def _spellings(v: Any) -> list[str]:
    """Texts of ``v`` under the documented false negatives (members in any order)."""
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
    "schema",
    [
        # A free number (additional member) judged by an integer grammar: "2.0" would be misjudged.
        {
            "type": "object",
            "oneOf": [
                {"properties": {"a": {"type": "integer", "multipleOf": 2}}},
                {"properties": {"b": {"type": "integer"}}, "required": ["b"]},
            ],
        },
        # An approximated format judging strings it did not write (validators differ on emails).
        {"type": "string", "not": {"format": "email"}},
        # A recursive branch: no automaton of it.
        {
            "$defs": {"t": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
            "oneOf": [{"$ref": "#/$defs/t"}, {"type": "array", "maxItems": 2, "items": {"format": "email"}}],
        },
    ],
)
def test_checks_that_cannot_be_exact_stay_refused(schema: Any) -> None:
    with pytest.raises(UnsupportedSchemaError) as info:
        Grammar.from_json_schema(schema)
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
