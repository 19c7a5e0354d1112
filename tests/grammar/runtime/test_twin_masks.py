"""Grammar core: twin masks (``grammar/mask/twin.cpp``).

A dense state that calls nothing within a token's reach takes the mask of an earlier state whose
neighbourhood agrees with its own as far as the longest token reaches (positions of a counted
string far from its end), or the classification of the tokens up to the depth they agree on
(positions nearer the end) plus a walk of the longer ones. Every token's bit is checked against
``accept_token`` on a fork all along strings with far and near positions (long runs of spaces and
dashes make long tokens; escapes and multi-byte characters), on a fresh tokenizer cache, also for
short bounded strings inside objects (whose positions compare through the pushdown walk), and the
profile shows that the far positions are served by twins instead of walks.
"""

from __future__ import annotations

import json

import pytest
from grammar_support import (
    assert_bits_match_acceptance,
    fresh_tokenizer_info,
    hf_tokenizer,
    mask_bits,
)

from agent_infer import _native
from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.ir import Grammar
from agent_infer.grammar.runtime.matcher import GrammarMatcher

SCHEMA = {
    "type": "object",
    "properties": {
        "far": {"type": "string", "maxLength": 1000},
        "near": {"type": "string", "minLength": 2, "maxLength": 150},
    },
    "required": ["far", "near"],
    "additionalProperties": False,
}
# "near" is filled to its bound, so its positions meet the end at every distance.
DOC = {
    "far": ("lorem ipsum " + " " * 24 + "-" * 33 + ' "q" \\ \u00e9\u65e5\U0001f600 ') * 3,
    "near": ("x" * 20 + " " * 30 + "=" * 20 + "\u00e9 tail " + "-" * 40 + "abc" * 12)[:150],
}


def _char_ids(name: str, text: str) -> list[int]:
    """One token per character (or its few byte tokens): the matcher visits every position."""
    tok = hf_tokenizer(name)
    return [t for ch in text for t in tok.encode(ch, add_special_tokens=False).ids]


@pytest.mark.parametrize(("tokenizer", "stride"), [("smollm2", 5), ("deepseek", 11)])
def test_twin_masks_exact(tokenizer: str, stride: int) -> None:
    info = fresh_tokenizer_info(tokenizer)
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(SCHEMA, whitespace="compact")
    )
    text = json.dumps(DOC, ensure_ascii=False, separators=(",", ":"))
    assert len(DOC["near"]) == 150
    ids = _char_ids(tokenizer, text)
    m = GrammarMatcher(compiled)
    checked = 0
    for pos, tid in enumerate(ids):
        if pos % stride == 0 or len(ids) - pos < 24:
            bits = mask_bits(m, info.vocab_size)
            assert_bits_match_acceptance(m, bits, pos)
            checked += 1
        else:
            mask_bits(m, info.vocab_size)  # every position visited, so twins chain along
        assert m.accept_token(tid), pos
    assert m.can_terminate()
    assert checked > 40


def test_far_positions_take_twin_masks() -> None:
    """Past the first positions of a long bounded string, no position walks the vocabulary: each
    takes a twin's mask or the content tokens whole (a walk of the few others only)."""
    info = fresh_tokenizer_info("smollm2")
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema({"type": "string", "maxLength": 1000}, whitespace="compact")
    )
    ids = _char_ids("smollm2", '"' + "word " * 40)
    m = GrammarMatcher(compiled)
    walks = {"full_plain", "full_calls", "short_fill", "pieces_walk", "region_walk"}
    counts: list[tuple[int, int]] = []
    try:
        _native.grammar_profile(True)
        _native.grammar_profile()
        for tid in ids:
            mask_bits(m, info.vocab_size)
            prof = _native.grammar_profile()
            # A twin or a content mask (grammar/mask/content.cpp, tried first) serves the position.
            served = prof.get("twin", (0, 0))[1] + prof.get("content", (0, 0))[1]
            counts.append((sum(prof[k][1] for k in walks & set(prof)), served))
            assert m.accept_token(tid)
    finally:
        _native.grammar_profile(False)
    assert len(counts) > 150
    later = counts[20:]
    assert sum(w for w, _ in later) == 0, later
    assert sum(t for _, t in later) >= len(later)


# Short bounded strings inlined into objects: their positions reach the rest of the object
# (calls) within a token, so they take twins through the pushdown walk's neighbourhood.
CALLS_SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "idTag": {"type": "string", "maxLength": 20},
            "parent": {"type": "string", "minLength": 1, "maxLength": 24},
            "n": {"type": "integer"},
        },
        "required": ["idTag", "n"],
    },
}
CALLS_DOC = [
    {"idTag": "12345678901234567890", "parent": "x" * 24, "n": 1},
    {"idTag": 'ab \u00e9\\"    ------', "parent": "q", "n": 22},
    {"idTag": "", "n": 3},
]


@pytest.mark.parametrize(("tokenizer", "stride"), [("smollm2", 2), ("deepseek", 5)])
def test_twin_masks_exact_with_calls(tokenizer: str, stride: int) -> None:
    info = fresh_tokenizer_info(tokenizer)
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(CALLS_SCHEMA, whitespace="compact")
    )
    ids = _char_ids(tokenizer, json.dumps(CALLS_DOC, ensure_ascii=False, separators=(",", ":")))
    m = GrammarMatcher(compiled)
    checked = 0
    for pos, tid in enumerate(ids):
        if pos % stride == 0:
            bits = mask_bits(m, info.vocab_size)
            assert_bits_match_acceptance(m, bits, pos)
            checked += 1
        else:
            mask_bits(m, info.vocab_size)
        assert m.accept_token(tid), pos
    assert m.can_terminate()
    assert checked > 20


# Fixed-length hex ids: positions where few tokens live but a third of the vocabulary is longer
# than the twin's agreement, so the longer tokens are walked as whole first-byte runs that pass the
# short ones by (inside an object: the pushdown walk), or through the list with dead runs carried
# across its blocks (alone: the plain walk).
HEX = {"type": "string", "pattern": "^[A-Fa-f\\d]{24}$"}
HEX_CASES = [
    (
        {"type": "array", "items": {"type": "object", "properties": {"id": HEX, "n": {"type": "integer"}}}},
        [
            {"id": "62a2f7a7a2f7a7a2f7a7a2f7", "n": 1},
            {"id": "0123456789abcdefABCDEF00"},
            {"id": "ffffffffffffffffffffffff", "n": 2},
        ],
    ),
    (
        {"type": "array", "items": HEX},
        ["62a2f7a7a2f7a7a2f7a7a2f7", "deadBEEF0123456789aaaaaa", "000000000000000000000000"],
    ),
]


@pytest.mark.parametrize("case", range(len(HEX_CASES)))
@pytest.mark.parametrize("tokenizer", ["smollm2", "deepseek"])
def test_twin_masks_exact_hex_ids(tokenizer: str, case: int) -> None:
    schema, doc = HEX_CASES[case]
    info = fresh_tokenizer_info(tokenizer)
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(schema, whitespace="compact")
    )
    ids = hf_tokenizer(tokenizer).encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False).ids
    m = GrammarMatcher(compiled)
    _native.grammar_profile(True)
    _native.grammar_profile()
    try:
        stride = 2 if tokenizer == "smollm2" else 3
        for pos, tid in enumerate(ids):
            bits = mask_bits(m, info.vocab_size)
            if pos % stride == 0:
                assert_bits_match_acceptance(m, bits, pos)
            assert m.accept_token(tid), pos
        prof = _native.grammar_profile()
    finally:
        _native.grammar_profile(False)
    assert m.can_terminate()
    assert prof.get("twin", (0, 0))[1] > 0, prof
