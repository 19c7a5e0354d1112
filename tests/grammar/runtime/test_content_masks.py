"""Grammar core: content masks (``grammar/mask/content.cpp``).

A state from which every string of up to 16 JSON string-content characters has a path accepts
every content token at once and walks only the other tokens (quotes, escapes, control bytes,
split characters, long tokens). Every token's bit is checked against ``accept_token`` on a fork
at positions inside free and bounded strings, alone (plain walk) and inside objects (pushdown
walk), on a fresh tokenizer cache; strings whose alphabet lacks a character, and positions near
a bound, must not take the shortcut; the profile shows where it is taken.
"""

from __future__ import annotations

import json
from typing import Any

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

TEXT = 'Grüße, "quoted" \\ back\tslash \u65e5\u672c\U0001f600 end'

CASES: list[tuple[str, Any, Any]] = [
    (
        "bounded strings in an object",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 255},
                "note": {"type": "string", "maxLength": 40},
                "n": {"type": "integer"},
            },
            "required": ["name"],
            "additionalProperties": False,
        },
        {"name": TEXT, "note": "x" * 30, "n": 3},
    ),
    ("bounded string alone", {"type": "string", "maxLength": 300}, TEXT * 2),
    (
        "strings in an array",
        {"type": "array", "items": {"type": "string", "maxLength": 64}},
        [TEXT, "", "ab"],
    ),
    # The alphabet lacks 'é': never all content, always the other first visits.
    ("alphabet without a character", {"type": "string", "pattern": "^[^\u00e9]*$", "maxLength": 200}, TEXT),
    # Filled to its bound: the last 16 positions take the content tokens that still fit.
    (
        "a string to its bound",
        {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 20}, "n": {"type": "integer"}},
            "required": ["name", "n"],
            "additionalProperties": False,
        },
        {"name": "Grüße \u65e5\u672c, ab \\ cd xy", "n": 7},
    ),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize(("tokenizer", "stride"), [("smollm2", 3), ("deepseek", 7)])
def test_content_masks_exact(tokenizer: str, stride: int, case: int) -> None:
    _, schema, doc = CASES[case]
    info = fresh_tokenizer_info(tokenizer)
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(schema, whitespace="compact")
    )
    tok = hf_tokenizer(tokenizer)
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
    # One token per character: the matcher visits every position of every string.
    ids = [t for ch in text for t in tok.encode(ch, add_special_tokens=False).ids]
    m = GrammarMatcher(compiled)
    _native.grammar_profile(True)
    _native.grammar_profile()
    checked = 0
    try:
        for pos, tid in enumerate(ids):
            bits = mask_bits(m, info.vocab_size)
            if pos % stride == 0:
                assert_bits_match_acceptance(m, bits, pos)
                checked += 1
            assert m.accept_token(tid), pos
        prof = _native.grammar_profile()
    finally:
        _native.grammar_profile(False)
    assert m.can_terminate()
    assert checked >= 5
    taken = prof.get("content", (0, 0))[1]
    if case == 3:
        assert taken > 0  # tried on the string's first visits...
        assert prof.get("full_plain", (0, 0))[1] + prof.get("full_calls", (0, 0))[1] > 0  # ...and refused
    else:
        assert taken > 0


def _mask_after(schema: Any, prefix: str) -> tuple[Any, dict[str, tuple[int, int]]]:
    """The DeepSeek-V4 mask after `prefix` on a fresh cache, and the native profile of that fill."""
    info = fresh_tokenizer_info("deepseek")
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(schema, whitespace="compact")
    )
    m = GrammarMatcher(compiled)
    assert m.accept_string(prefix)
    _native.grammar_profile(True)
    _native.grammar_profile()
    try:
        bits = mask_bits(m, info.vocab_size)
        prof: dict[str, tuple[int, int]] = _native.grammar_profile()
    finally:
        _native.grammar_profile(False)
    return bits, prof


def test_first_visit_of_a_bounded_string_walks_a_few_tokens() -> None:
    """The first position of a `maxLength` string inside an object costs a walk of the
    non-content tokens, not of the vocabulary (no full walk at that step)."""
    bits, prof = _mask_after(CASES[0][1], '{"name":"')
    assert prof.get("content", (0, 0))[1] == 1, prof
    assert "full_plain" not in prof and "full_calls" not in prof, prof
    # Content tokens are in, the closing quote's continuation decides the rest.
    word = hf_tokenizer("deepseek").encode("hello", add_special_tokens=False).ids[0]
    assert bits[word] and bits.sum() > 100_000


def test_last_positions_of_a_bounded_string_take_the_tokens_that_fit() -> None:
    """Within 16 characters of a `maxLength` bound, the content tokens that still fit are taken
    whole, the longer ones are out, and only the other tokens are walked: no twin walk of the
    longer tokens, no full walk."""
    bits, prof = _mask_after(CASES[4][1], '{"name":"' + "a" * 14)  # 6 characters left
    assert prof.get("content", (0, 0))[1] == 1, prof
    assert "twin" not in prof and "full_plain" not in prof and "full_calls" not in prof, prof
    tok = hf_tokenizer("deepseek")
    fits = tok.encode("hello", add_special_tokens=False).ids
    too_long = tok.encode(" international", add_special_tokens=False).ids
    assert len(fits) == 1 and len(too_long) == 1
    assert bits[fits[0]] and not bits[too_long[0]]
