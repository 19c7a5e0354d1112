"""Exact ``oneOf`` over branches that overlap or need a proof of disjointness, and negations of
``oneOf``/``items``/``prefixItems`` (under ``not``), against jsonschema.

Each schema must compile in strict mode (a regression to "unsupported" fails), and on every
candidate instance the native matcher (bytes-only vocabulary, token by token) must agree with
jsonschema, up to the documented false negatives (member order, ``3.0`` for an integer).
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import pytest

from agent_infer.errors import UnsupportedSchemaError
from agent_infer.grammar import CompiledGrammar, Grammar, GrammarCompiler, GrammarMatcher, TokenizerInfo


@pytest.fixture(scope="module")
def byte_compiler() -> GrammarCompiler:
    return GrammarCompiler(TokenizerInfo.bytes_only(), cache_enabled=False)


def _accepts(compiled: CompiledGrammar, text: str) -> bool:
    m = GrammarMatcher(compiled)
    return m.accept_string(text) and m.can_terminate()


_NUM = {"type": "number"}
_CLOSED = [
    {
        "type": "object",
        "properties": {"initial": _NUM},
        "required": ["initial"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"suggested": _NUM},
        "required": ["suggested"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"initial": _NUM, "suggested": _NUM},
        "required": ["initial", "suggested"],
        "additionalProperties": False,
    },
]

# Schemas whose oneOf branches a proof shows disjoint (plain alternation), or that split by type
# into parts each so decided (applicators/by_type.py).
PROVED: list[Any] = [
    {"oneOf": _CLOSED},
    # A branch's own oneOf names its types: apart from an object branch.
    {"oneOf": [{"oneOf": [{"type": "string"}, {"type": "integer"}]}, {"type": "object", "required": ["a"]}]},
    # A member one branch requires and the other declares with a disjoint schema.
    {
        "oneOf": [
            {"type": "object", "required": ["t"], "properties": {"t": {"const": "a"}}},
            {"type": "object", "properties": {"t": {"const": "b"}}},
        ]
    },
    # Listed values less those the sibling pattern rejects.
    {
        "oneOf": [
            {"type": "object", "required": ["k"], "properties": {"k": {"enum": ["x", "y"], "pattern": "^x"}}},
            {"type": "object", "required": ["k"], "properties": {"k": {"enum": ["x", "y"], "pattern": "^y"}}},
        ]
    },
    # Two required names against maxProperties 1.
    {"oneOf": [{"type": "object", "required": ["a", "b"]}, {"type": "object", "maxProperties": 1}]},
    # Objects apart, null in both: split by type, null left out.
    {
        "oneOf": [
            {"type": ["object", "null"], "required": ["a"], "properties": {"a": {"const": 1}}},
            {"type": ["object", "null"], "required": ["a"], "properties": {"a": {"const": 2}}},
        ]
    },
    # Booleans: true in both, false in the first only; strings only in the first.
    {"oneOf": [{"type": ["boolean", "string"], "minLength": 2}, {"type": "boolean", "const": True}]},
    {
        "oneOf": [
            {"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]},
            {"required": ["b"], "type": "object", "properties": {"a": False}},
        ]
    },
    {
        "type": "object",
        "oneOf": [
            {
                "properties": {
                    "k": {"type": "object", "properties": {"t": {"const": "x"}}, "required": ["t"]}
                },
                "required": ["k"],
            },
            {
                "properties": {
                    "k": {"type": "object", "properties": {"t": {"const": "y"}}, "required": ["t"]}
                },
                "required": ["k"],
            },
        ],
    },
    {
        "type": "array",
        "oneOf": [
            {"minItems": 1, "items": {"type": "string"}},
            {"minItems": 1, "items": {"type": "integer"}},
        ],
    },
    {"type": "array", "oneOf": [{"minItems": 2}, {"maxItems": 1}]},
    {"type": "string", "oneOf": [{"minLength": 3}, {"maxLength": 2}]},
    {"oneOf": [{"type": "number", "minimum": 5}, {"type": "integer", "exclusiveMaximum": 5}]},
    {"oneOf": [{"type": "number", "maximum": 5}, {"type": "number", "exclusiveMinimum": 5}]},
    {
        "type": "object",
        "oneOf": [{"patternProperties": {"^x": False}, "required": ["b"]}, {"required": ["xa"]}],
    },
    # Member values told apart by patterns no string matches together.
    {
        "type": "object",
        "required": ["t"],
        "oneOf": [{"properties": {"t": {"pattern": "^a$"}}}, {"properties": {"t": {"pattern": "^ab?c"}}}],
    },
]

# Overlapping branches made disjoint with complements the new negations express.
COMPLEMENTED: list[Any] = [
    {
        "oneOf": [
            {"type": "string"},
            {"type": "array", "items": {"type": "string"}},
            {"type": "array", "items": {"type": "integer"}},
        ]
    },
    {"type": "array", "oneOf": [{"items": {"type": "integer"}}, {"items": {"maximum": 2}}]},
    {
        "type": "array",
        "oneOf": [{"prefixItems": [{"type": "string"}]}, {"prefixItems": [{"const": "a"}, {}]}],
    },
    {"oneOf": [{"type": "object", "oneOf": [{"required": ["a"]}, {"required": ["b"]}]}, {"required": ["c"]}]},
    {"not": {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]}},
    {"type": "object", "not": {"oneOf": [{"required": ["a"]}, {"maxProperties": 1}, {"required": ["c"]}]}},
    {"not": {"not": {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]}}},
    {"type": "array", "not": {"items": {"type": "integer"}}},
    # additionalProperties complements: "some member outside the declared names violates it".
    {
        "oneOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
            {"type": "object", "properties": {"b": {"type": "integer"}}, "additionalProperties": False},
        ]
    },
    {"not": {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}},
    {
        "type": "object",
        "properties": {"a": {}, "b": {"type": "string"}},
        "not": {"properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
    },
    {
        "type": "object",
        "patternProperties": {"^x": {"type": "string"}},
        "not": {"additionalProperties": {"type": "integer"}},
    },
    # Three closed objects that all take {}: each branch meets two complements at once.
    {
        "oneOf": [
            {"type": "object", "properties": {"a": {}}, "additionalProperties": False},
            {"type": "object", "properties": {"b": {}}, "additionalProperties": False},
            {"type": "object", "properties": {"c": {}}, "additionalProperties": False},
        ]
    },
    # patternProperties merged with another allOf part's additionalProperties.
    {
        "type": "object",
        "allOf": [
            {"patternProperties": {"^x": {"type": "string"}}, "additionalProperties": {"type": "integer"}},
            {"properties": {"b": {}}, "additionalProperties": {"minimum": 1}},
        ],
    },
    # Complements of listed numbers, arrays and objects (nested, and beside minProperties 1).
    {"not": {"const": {}}},
    {"not": {"enum": [1, "a", [1, "b"]]}},
    {"type": "object", "not": {"const": {"a": [1], "b": "x"}}},
    {"type": "object", "minProperties": 1, "not": {"const": {"k": {"t": "x"}}}},
    {"not": {"enum": [3, 5.5]}},
    # contains: every item in the item complement.
    {"type": "array", "not": {"contains": {"type": "integer"}}},
    # A recursive complement (deferred at the repeated $ref) and a oneOf of five, pairs only where needed.
    {
        "$defs": {
            "t": {"type": "object", "properties": {"a": {"$ref": "#/$defs/t"}, "v": {"type": "integer"}}}
        },
        "not": {"$ref": "#/$defs/t"},
    },
    {
        "not": {
            "oneOf": [
                {"type": "string"},
                {"type": "integer"},
                {"type": "boolean"},
                {"type": "object", "required": ["a"]},
                {"type": "object", "maxProperties": 1},
            ]
        }
    },
    # More than three patternProperties: only the key regions that can be non-empty.
    {
        "type": "object",
        "patternProperties": {
            "^x": {"type": "string"},
            "a$": {"type": "integer"},
            "^y": {"const": 1},
            "^xa$": {"minLength": 2},
            "^q$": False,
        },
        "additionalProperties": False,
    },
    # Two oneOfs under allOf: the second is lowered inside each branch of the first.
    {
        "type": "object",
        "allOf": [
            {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
            {"oneOf": [{"required": ["c"]}, {"maxProperties": 1}]},
        ],
    },
    {
        "allOf": [
            {"oneOf": [{"type": "string"}, {"type": "integer"}]},
            {"oneOf": [{"minLength": 2}, {"maximum": 2}]},
        ]
    },
    # oneOf next to anyOf: the oneOf goes into each anyOf branch.
    {
        "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
        "oneOf": [{"required": ["c"]}, {"maxProperties": 1}],
    },
    {"not": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}},
]

CANDIDATES: list[Any] = [
    *({}, {"a": 1}, {"b": 1}, {"c": 1}, {"a": 1, "b": 2}, {"a": 1, "c": 3}, {"b": 1, "c": 2}, {"a": 2}),
    *({"a": 1, "b": 2, "c": 3}, {"xa": 1}, {"xa": 1, "b": 1}, {"b": 1, "a": 1}, {"a": None}),
    *(
        {"b": "s"},
        {"a": 1, "b": "s"},
        {"a": "s", "z": 1},
        {"z": "q"},
        {"xa": "s"},
        {"xa": "s", "z": 1},
        {"xa": 1, "z": "q"},
    ),
    *({"initial": 1}, {"suggested": 2.5}, {"initial": 1, "suggested": 2}, {"initial": 1, "x": 1}),
    *({"k": {"t": "x"}}, {"k": {"t": "y"}}, {"k": {"t": "z"}}, {"k": {}}, {"k": 1}),
    *([], [1], [2], [3], ["a"], [1, 1], [1, 2], [2, 1], [1, "a"], ["a", 1], ["a", "b"], [1, 2, 3]),
    *([3, 3], [None], [1.5], [0, "a"], [1, "b"], [1.0, "b"], [1, "b", 2], [2, "b"], [1, "c"]),
    *({"a": [1], "b": "x"}, {"b": "x", "a": [1]}, {"a": [1], "b": "y"}, {"a": [2], "b": "x"}, {"a": 1.0}),
    *({"k": {"t": "x"}, "z": 1}, 3.0, 5.50, 5.25, {"xa": "ss"}, {"ya": 1}, {"ya": 2}, {"y": 1, "xb": "s"}),
    *({"q": 1}, {"xb": 1}, {"ba": 1, "xc": "t"}, {"t": "a"}, {"t": "abc"}, {"t": "ac"}, {"t": "b"}, {"t": 1}),
    *(
        {"a": {"a": {"v": 1}}},
        {"a": {"a": {"v": "s"}}},
        {"a": {"a": 1}},
        {"v": 1, "a": {}},
        {"a": {"v": 1.5}},
    ),
    *("", "a", "ab", "abc", "abcd", -1, 0, 1, 2, 4, 5, 6, 4.5, 5.5, None, True, False),
    *({"k": "x"}, {"k": "y"}, {"k": "z"}, {"t": "a", "u": 1}, {"a": 2, "b": 3}),
]


def _int_spelled(v: Any) -> Any:
    """``v`` with integral floats as integers (``3.0`` for an integer is a documented false negative)."""
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, list):
        return [_int_spelled(x) for x in v]
    if isinstance(v, dict):
        return {k: _int_spelled(x) for k, x in v.items()}
    return v


def _spellings(v: Any) -> list[str]:
    """Texts of ``v`` under the documented false negatives: members in any order, 3.0 as 3."""
    v = _int_spelled(v)
    if isinstance(v, dict):
        return [json.dumps(dict(p), separators=(",", ":")) for p in itertools.permutations(v.items())]
    return [json.dumps(v, separators=(",", ":"))]


@pytest.mark.parametrize("schema", PROVED + COMPLEMENTED, ids=lambda s: json.dumps(s)[:60])
def test_one_of_and_negations_are_exact(schema: Any, byte_compiler: GrammarCompiler) -> None:
    compiled = byte_compiler.compile(Grammar.from_json_schema(schema, whitespace="compact"))
    oracle = jsonschema.Draft202012Validator(schema)
    wrong: list[str] = []
    for inst in CANDIDATES:
        text = json.dumps(inst, separators=(",", ":"))
        got, valid = _accepts(compiled, text), oracle.is_valid(inst)
        if got and not valid:
            wrong.append(f"accepts invalid {text}")
        elif valid and not got and not any(_accepts(compiled, t) for t in _spellings(inst)):
            wrong.append(f"rejects valid {text}")
    assert not wrong, wrong


def test_indent_layout_agrees(byte_compiler: GrammarCompiler) -> None:
    """The same languages under the pinned indent layout (no false accepts)."""
    for schema in PROVED + COMPLEMENTED:
        compiled = byte_compiler.compile(Grammar.from_json_schema(schema, indent=2))
        oracle = jsonschema.Draft202012Validator(schema)
        for inst in CANDIDATES:
            if _accepts(compiled, json.dumps(inst, indent=2)):
                assert oracle.is_valid(inst), (schema, inst)


@pytest.mark.parametrize(
    "schema",
    [
        # A complement that is still not expressible (an item's format) keeps oneOf unsupported.
        {"type": "array", "oneOf": [{"items": {"format": "email"}}, {"minItems": 1}]},
        # Seventeen overlapping branches: past the complements' bound and a check's 16 items.
        {"type": "object", "oneOf": [{"required": [f"k{i}"]} for i in range(17)]},
    ],
)
def test_still_refused_with_pointer(schema: Any) -> None:
    with pytest.raises(UnsupportedSchemaError) as info:
        Grammar.from_json_schema(schema)
    assert info.value.pointer is not None and "oneOf" in info.value.pointer


def test_overlapping_pattern_regions_past_the_limit_are_refused() -> None:
    """Seven unanchored patterns all overlap (one key can match them all): 128 possible key
    regions, past MAX_REGIONS; strict mode names the patternProperties, non-strict drops them."""
    pats = {ch: {"type": "integer"} for ch in "abcdefg"}
    schema = {"type": "object", "patternProperties": pats}
    with pytest.raises(UnsupportedSchemaError) as info:
        Grammar.from_json_schema(schema)
    assert (info.value.keyword, info.value.pointer) == ("patternProperties", "/patternProperties")
    assert "key regions" in str(info.value)
    loose = Grammar.from_json_schema(schema, strict=False)
    assert any("patternProperties" in w for w in loose.warnings)


# Masks over the DeepSeek-V4 vocabulary (token by token, every id checked against accept +
# rollback) at every position of a valid instance, where the grammars of the new lowerings decide:
# a member that meets a complement of additionalProperties, the member that would make an object
# the excluded const, a negated oneOf and a pattern key region.
MASK_CASES: list[tuple[Any, Any]] = [
    (
        {
            "oneOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
                {"type": "object", "properties": {"b": {"type": "integer"}}, "additionalProperties": False},
            ]
        },
        {"a": 1},
    ),
    (
        {"not": {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}}},
        {"a": "s", "z": "t"},
    ),
    ({"type": "object", "not": {"const": {"k": {"t": "x"}}}}, {"k": {"t": "y"}}),
    ({"not": {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]}}, {"a": 1, "b": 2}),
    (
        {
            "type": "object",
            "patternProperties": {"^x": {"type": "string"}, "a$": {"maxLength": 3}, "^y": {}, "^q$": False},
            "additionalProperties": False,
        },
        {"xa": "abc", "ya": 1},
    ),
]


@pytest.mark.parametrize(("schema", "doc"), MASK_CASES, ids=lambda x: json.dumps(x)[:40])
def test_masks_exact_on_a_real_vocabulary(schema: Any, doc: Any) -> None:
    from grammar_support import assert_mask_exact, hf_tokenizer, tokenizer_info

    assert jsonschema.Draft202012Validator(schema).is_valid(doc)
    compiled = GrammarCompiler(tokenizer_info("deepseek"), cache_enabled=False).compile(
        Grammar.from_json_schema(schema, whitespace="compact")
    )
    text = json.dumps(doc, separators=(",", ":"))
    ids = hf_tokenizer("deepseek").encode(text, add_special_tokens=False).ids
    m = GrammarMatcher(compiled)
    for pos, tid in enumerate(ids):
        assert_mask_exact(m, pos)
        assert m.accept_token(tid), pos
    assert_mask_exact(m, len(ids))
    assert m.can_terminate()
