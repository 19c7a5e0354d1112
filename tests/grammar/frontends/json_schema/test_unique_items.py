"""``uniqueItems`` beyond ``maxItems: 1``: the run-time check on UniqueItem rules and the listed
value sets, against jsonschema and against the matcher's own acceptance.

* Every schema below compiles strictly, and on each candidate instance the native matcher (bytes-only
  vocabulary; compact, flexible and indent=2 layouts) agrees with jsonschema, up to the documented
  false negatives (member order).
* Masks are exact: at every position of texts that run into a duplicate (the byte that completes
  it included), each token's bit equals accept-and-rollback, over the bytes-only vocabulary and over
  DeepSeek-V4's; and every token a mask allows can still be completed to a valid document (a
  search over bytes), so no begun item is left without an unused value.
* The reference recognizer agrees with the native matcher; item schemas that cannot be enforced
  exactly are refused with the keyword, pointer and reason.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import jsonschema
import numpy as np
import pytest

from agent_infer.errors import GrammarLimitError, UnsupportedSchemaError
from agent_infer.grammar import CompiledGrammar, Grammar, GrammarCompiler, GrammarMatcher, TokenizerInfo
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer

RUNTIME: list[Any] = [
    {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "uniqueItems": True, "maxItems": 4},
    {"type": "array", "items": {"type": ["string", "null", "boolean"]}, "uniqueItems": True},
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "minItems": 2},
    {"type": "array", "items": {"type": "number"}, "uniqueItems": True},
    {"type": "array", "items": {"type": "integer", "minimum": 0}, "uniqueItems": True},
    {"type": "array", "items": {"type": "integer", "not": {"enum": [0]}}, "uniqueItems": True},
    {"type": "array", "items": {}, "uniqueItems": True},
    {
        "type": "array",
        "items": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "uniqueItems": True,
    },
    # A closed object whose members all have unboundedly many values.
    {
        "type": "array",
        "uniqueItems": True,
        "items": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "v": {"type": "integer"}},
            "required": ["name", "v"],
            "additionalProperties": False,
        },
    },
    {"type": "array", "items": {"type": "string", "pattern": "^[a-z]+$"}, "uniqueItems": True},
    {
        "type": "array",
        "items": {"anyOf": [{"type": "string"}, {"enum": ["x", 1.5]}, {"type": "number"}]},
        "uniqueItems": True,
    },
    {"type": "array", "prefixItems": [{"type": "number"}], "items": {"type": "integer"}, "uniqueItems": True},
    {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}, "uniqueItems": True},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
    },
    # Positions with few values: the first takes anything, the second booleans (one left).
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"type": "boolean"}], "uniqueItems": True},
    {
        "type": "array",
        "prefixItems": [{"const": "x"}, {"type": "boolean"}],
        "items": False,
        "uniqueItems": True,
    },
    # A closed object: the member with few values comes before members with unboundedly many, in
    # declared order and in required-first order.
    {
        "type": "array",
        "uniqueItems": True,
        "items": {
            "type": "object",
            "properties": {"name": {"enum": ["a", "b"]}, **{k: {"type": "string"} for k in "vwxyzq"}},
            "required": ["name", "v"],
            "additionalProperties": False,
        },
    },
]

LISTED: list[Any] = [
    {"type": "array", "items": {"enum": ["http", "https", "ws", "wss"]}, "uniqueItems": True},
    {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True, "minItems": 1},
    {"type": "array", "items": {"enum": ["ab", "abc", 1, 1.0, None]}, "uniqueItems": True, "maxItems": 2},
    {"type": "array", "items": {"enum": [{"k": 1}, [1, 2], "x"]}, "uniqueItems": True, "minItems": 3},
]

CANDIDATES: list[Any] = [
    *([], ["a"], ["a", "b"], ["a", "a"], ["a", "b", "a"], ["ab", "a", "abc", "ab"], ["", ""], ["", "a"]),
    *(["a", None, True, "true", False], [True, True], [None, None], [True, False], [False]),
    *([1, 12, 0, 10], [0, -0], [5, 50, 500, 5], [1, 1.0], [1, 2.5, 1.0], [0.1, 0.10], [2, -2], [0], [7]),
    *([1, "1"], [[1], [1]], [[1], [1, 1]], [[], []], [{"a": 1}, {"a": 1}], [{}, {}], [{"a": 1}, {"a": 2}]),
    *([{"a": 1}, {"a": 1, "b": 2}], [{"a": 1, "b": 2}, {"a": 1, "b": 2}], [{"k": 1}, [1, 2], "x"]),
    *([{"name": "a", "v": "x"}, {"name": "a", "v": "x"}], [{"name": "a", "v": "x"}, {"name": "b", "v": "x"}]),
    *([{"name": "a", "v": 1}, {"v": 1, "name": "a"}], [{"name": "a", "v": 1}, {"name": "a", "v": 2}]),
    *(["http", "https"], ["ws", "ws"], ["http", "https", "ws", "wss"], ["x", "x"], [1.5, 1.50], ["x", 1.5]),
    *(["ab", 1], [1, 1.0], ["ab", "abc"], [None, "ab"], ["é", "\u00e9"], ["a\nb", "a\nb"], ["A", "a"]),
    *({"tags": ["a", "b"]}, {"tags": ["a", "a"]}, {"tags": []}, {"other": [1, 1]}),
    *([2.5, 2], [2.5, 2.5], [3, 3.0], [[1, [2]], [1, [2]]], ["Z", "Zz", "zZ"]),
    *(
        [True, True],
        [True, False],
        [False, True, 1],
        [True, False, True],
        ["x", True],
        ["x", "x"],
        [True, "x"],
    ),
]


@pytest.fixture(scope="module")
def byte_compiler() -> GrammarCompiler:
    return GrammarCompiler(TokenizerInfo.bytes_only(), cache_enabled=False)


def _accepts(compiled: CompiledGrammar, text: str) -> bool:
    m = GrammarMatcher(compiled)
    return m.accept_string(text) and m.can_terminate()


def _spellings(v: Any) -> list[str]:
    """Compact texts of ``v`` with object members in every order (member order is a documented
    false negative)."""

    def variants(x: Any) -> list[Any]:
        if isinstance(x, dict):
            out = []
            for perm in itertools.permutations(x.items()):
                for vals in itertools.product(*(variants(val) for _, val in perm)):
                    out.append(dict(zip([k for k, _ in perm], vals, strict=True)))
            return out
        if isinstance(x, list):
            return [list(p) for p in itertools.product(*(variants(i) for i in x))] if x else [[]]
        return [x]

    return [json.dumps(x, separators=(",", ":"), ensure_ascii=False) for x in variants(v)[:24]]


def _layouts(inst: Any) -> list[tuple[str, str]]:
    return [
        ("compact", json.dumps(inst, separators=(",", ":"), ensure_ascii=False)),
        ("flexible", json.dumps(inst, separators=(", ", ": "))),
        ("indent", json.dumps(inst, indent=2)),
    ]


@pytest.mark.parametrize("schema", RUNTIME + LISTED, ids=lambda s: json.dumps(s)[:70])
def test_agrees_with_jsonschema(schema: Any, byte_compiler: GrammarCompiler) -> None:
    oracle = jsonschema.Draft202012Validator(schema)
    grammars = {
        "compact": byte_compiler.compile(Grammar.from_json_schema(schema, whitespace="compact")),
        "flexible": byte_compiler.compile(Grammar.from_json_schema(schema)),
        "indent": byte_compiler.compile(Grammar.from_json_schema(schema, indent=2)),
    }
    wrong: list[str] = []
    for inst in CANDIDATES:
        valid = oracle.is_valid(inst)
        for layout, text in _layouts(inst):
            got = _accepts(grammars[layout], text)
            if got and not valid:
                wrong.append(f"{layout} accepts invalid {text}")
            elif (
                valid
                and not got
                and layout == "compact"
                and not any(_accepts(grammars[layout], t) for t in _spellings(inst))
            ):
                wrong.append(f"{layout} rejects valid {text}")
    assert not wrong, wrong


def test_runtime_and_listed_lowerings_are_the_ones_used() -> None:
    for schema in RUNTIME:
        assert "%unique(" in str(Grammar.from_json_schema(schema)), schema
    for schema in LISTED:
        assert "%unique(" not in str(Grammar.from_json_schema(schema)), schema


def _mask_ids(m: GrammarMatcher, vocab: int) -> np.ndarray:
    from grammar_support import mask_bits

    return mask_bits(m, vocab)[:vocab]


DUPLICATE_TEXTS: list[tuple[int, str]] = [
    (0, '["a","b","a"]'),
    (0, '["ab","a","abc","ab"]'),
    (0, '["\\u0061","a"]'),
    (2, '["a",null,true,"true",false,null]'),
    (3, "[1,12,0,-0,10]"),
    (4, "[1,1.0,10e-1,2]"),
    (4, "[0,-0.0,0e5]"),
    (7, '[1,"1",[1],{"a":1},null,true,[1]]'),
    (8, '[{"a":1},{"a":1}]'),
    (9, '[{"name":"a","v":1},{"name":"a","v":1}]'),
    (17, '[{"name":"a","v":"x"},{"name":"a","v":"x"}]'),
    (15, "[true,true]"),
    (11, '["x",1.5,1.50]'),
    (12, "[2.5,2,2.50]"),
    (13, "[[1],[1,[]],[1]]"),
]


@pytest.mark.parametrize(("schema_at", "text"), DUPLICATE_TEXTS, ids=lambda x: str(x)[:40])
@pytest.mark.parametrize("whitespace", ["compact", "flexible"])
def test_masks_exact_and_completable_bytes_only(
    schema_at: int, text: str, whitespace: str, byte_compiler: GrammarCompiler
) -> None:
    """At every byte of a text that runs into a duplicate: the mask equals accept-and-rollback,
    and each allowed byte leads to a completable document (so a begun item never gets stuck)."""
    from grammar_support import assert_bits_match_acceptance

    schema = (RUNTIME + LISTED)[schema_at]
    compiled = byte_compiler.compile(Grammar.from_json_schema(schema, whitespace=whitespace))
    info = compiled.tokenizer_info
    if whitespace == "flexible":
        text = text.replace(",", ", ")
    m = GrammarMatcher(compiled)
    data = text.encode()
    stopped = False
    for pos in range(len(data)):
        bits = _mask_ids(m, info.vocab_size)
        assert_bits_match_acceptance(m, bits, pos)
        for tid in np.flatnonzero(bits):
            if int(tid) in info.eos_token_ids:
                continue
            assert m.accept_token(int(tid))
            assert _completable(m, info.vocab_size, 48, [4000]), (text[:pos], info.token_bytes(int(tid)))
            m.rollback(1)
        if not m.accept_string(data[pos : pos + 1]):
            stopped = True
            break
    assert stopped, "the text holds a duplicate: the matcher must stop at the byte completing it"


_ORDER = [ord(ch) for ch in '"]},:0123456789zabntf-.[{ ']


def _completable(m: GrammarMatcher, vocab: int, depth: int, budget: list[int]) -> bool:
    """Whether some bytes (a depth-first search, closing characters first) complete ``m`` to a
    string of the grammar; the matcher is left as it was."""
    budget[0] -= 1
    if m.can_terminate():
        return True
    if depth == 0 or budget[0] <= 0:
        return False
    bits = _mask_ids(m, vocab)
    for b in [*_ORDER, *(x for x in range(256) if x not in _ORDER)]:
        if not bits[b]:
            continue
        assert m.accept_token(b)
        found = _completable(m, vocab, depth - 1, budget)
        m.rollback(1)
        if found:
            return True
    return False


# DeepSeek-V4 masks (every id against accept + rollback) where an item completes or is about to:
# multi-byte tokens such as `"a"` or `",` close an item and may open the next within one token.
REAL_VOCAB_CASES: list[tuple[int, str, list[str]]] = [
    (0, '["alpha","beta","alpha"]', ['["alpha",', '["alpha","beta",', '["alpha","beta","']),
    (2, '[null,"x",true,null]', ["[null,", '[null,"x",true,']),
    (17, '[{"name":"a","v":"x"},{"name":"a","v":"x"}]', ['[{"name":"a","v":"x"},{"name":"a","v":"']),
    (9, '[{"name":"a","v":1},{"name":"a","v":1}]', ['[{"name":"a","v":1},{"name":"a","v":']),
    (0, '["ab", "abc", "ab"]', ['["ab", "abc", "']),
]


@pytest.mark.parametrize(("schema_at", "text", "prefixes"), REAL_VOCAB_CASES, ids=lambda x: str(x)[:30])
def test_masks_exact_on_a_real_vocabulary(schema_at: int, text: str, prefixes: list[str]) -> None:
    from grammar_support import assert_mask_exact, tokenizer_info

    compiled = GrammarCompiler(tokenizer_info("deepseek"), cache_enabled=False).compile(
        Grammar.from_json_schema((RUNTIME + LISTED)[schema_at])
    )
    for prefix in prefixes:
        m = GrammarMatcher(compiled)
        assert m.accept_string(prefix)
        assert_mask_exact(m, len(prefix))
    assert not _accepts(compiled, text)


def test_the_reference_recognizer_agrees(byte_compiler: GrammarCompiler) -> None:
    for schema in RUNTIME:
        g = Grammar.from_json_schema(schema, whitespace="compact")
        rec = ReferenceRecognizer(g)
        compiled = byte_compiler.compile(g)
        for inst in CANDIDATES:
            text = json.dumps(inst, separators=(",", ":"), ensure_ascii=False)
            assert rec.accepts(text) == _accepts(compiled, text), (schema, text)


def test_gbnf_round_trip() -> None:
    g = Grammar.from_json_schema(RUNTIME[2])
    assert Grammar.from_ebnf(str(g), syntax="gbnf") == g


def test_forks_and_rollback_keep_the_items(byte_compiler: GrammarCompiler) -> None:
    compiled = byte_compiler.compile(Grammar.from_json_schema(RUNTIME[0], whitespace="compact"))
    m = GrammarMatcher(compiled)
    assert m.accept_string('["a","b",')
    f = m.fork()
    assert not f.accept_string('"a"') and f.accept_string('"c"]') and f.can_terminate()
    assert m.accept_string('"zz"')
    m.rollback(1)
    assert not m.accept_string('"b"') and m.accept_string('"bb"]')


REFUSED: list[tuple[Any, str]] = [
    ({"type": "array", "items": {"type": "string", "maxLength": 5}, "uniqueItems": True}, "/uniqueItems"),
    ({"type": "array", "items": {"type": "string", "format": "date"}, "uniqueItems": True}, "/uniqueItems"),
    (
        {"type": "array", "items": {"type": "integer", "maximum": 9, "minimum": 0}, "uniqueItems": True},
        "/uniqueItems",
    ),
    ({"type": "array", "items": {"type": "integer", "maximum": 15}, "uniqueItems": True}, "/uniqueItems"),
    ({"type": "array", "items": {"type": "number", "minimum": -15}, "uniqueItems": True}, "/uniqueItems"),
    ({"type": "array", "items": {"enum": list(range(9))}, "uniqueItems": True}, "/uniqueItems"),
    (
        {
            "type": "array",
            "items": {"anyOf": [{"enum": ["ab", "ac"]}, {"type": "integer"}]},
            "uniqueItems": True,
        },
        "/uniqueItems",
    ),
    (
        {
            "type": "array",
            "uniqueItems": True,
            "items": {
                "type": "object",
                "properties": {"v": {"type": "string"}, "on": {"type": "boolean"}},
                "additionalProperties": False,
            },
        },
        "/uniqueItems",
    ),
    # In required-first order the member with few values comes last.
    (
        {
            "type": "array",
            "uniqueItems": True,
            "items": {
                "type": "object",
                "properties": {"name": {"enum": ["a", "b"]}, "v": {"type": "string"}},
                "required": ["v", "name"],
                "additionalProperties": False,
            },
        },
        "/uniqueItems",
    ),
    (
        {"type": "array", "items": {"type": "string"}, "contains": {"const": "a"}, "uniqueItems": True},
        "/uniqueItems",
    ),
    (
        {"type": "array", "prefixItems": [{"type": "string"}, {"enum": ["a", "b"]}], "uniqueItems": True},
        "/uniqueItems",
    ),
    (
        {
            "type": "object",
            "properties": {"p": {"type": "array", "items": {"pattern": "^(ab|cd)$"}, "uniqueItems": True}},
        },
        "/properties/p/uniqueItems",
    ),
]


@pytest.mark.parametrize(("schema", "pointer"), REFUSED, ids=lambda x: json.dumps(x)[:60])
def test_refused_with_keyword_pointer_and_reason(schema: Any, pointer: str) -> None:
    with pytest.raises(UnsupportedSchemaError) as info:
        Grammar.from_json_schema(schema)
    assert (info.value.keyword, info.value.pointer) == ("uniqueItems", pointer)
    assert "not enforceable" in str(info.value)
    loose = Grammar.from_json_schema(schema, strict=False)
    assert any("uniqueItems" in w for w in loose.warnings)


def test_float64_numbers_need_a_small_max_items() -> None:
    """Under the float64 digit policy a begun number can have 11 completions left: unique arrays
    of numbers need maxItems <= 11 there (the exact policy has no such bound)."""
    items = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(UnsupportedSchemaError, match="float64"):
        Grammar.from_json_schema(items, numbers="float64")
    assert "%unique(" in str(Grammar.from_json_schema({**items, "maxItems": 11}, numbers="float64"))
    assert "%unique(" in str(Grammar.from_json_schema(items))


def test_run_time_limits_raise_grammar_limit_error(byte_compiler: GrammarCompiler) -> None:
    """Items nested past 256 levels, or numbers with an exponent past 10^15, cannot be compared:
    the step that would compare them raises GrammarLimitError and leaves the matcher as it was."""
    compiled = byte_compiler.compile(Grammar.from_json_schema(RUNTIME[7], whitespace="compact"))
    m = GrammarMatcher(compiled)
    assert m.accept_string("[1,")
    with pytest.raises(GrammarLimitError, match="nested deeper"):
        m.accept_string("[" * 300 + "]" * 300)
    assert m.accept_string("2]") and m.can_terminate()
    m = GrammarMatcher(compiled)
    with pytest.raises(GrammarLimitError, match="exponent"):
        m.accept_string("[1,1e9999999999999999,")


def test_the_shortest_completion_never_repeats_an_item(byte_compiler: GrammarCompiler) -> None:
    """The grammar's shortest completion of `["a",` is `""]`; after `["",` it would repeat "",
    so there is none to offer (closing on max_tokens then does not apply)."""
    compiled = byte_compiler.compile(Grammar.from_json_schema(RUNTIME[0], whitespace="compact"))
    m = GrammarMatcher(compiled)
    assert m.accept_string('["a",') and m.shortest_completion() == b'""]'
    m = GrammarMatcher(compiled)
    assert m.accept_string('["",') and m.shortest_completion() is None
