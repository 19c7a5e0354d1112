"""Grammar core: exact masks inside length-bounded strings (``minLength``/``maxLength``).

The positions of a bounded string are distinct automaton states that share the masks of their
short tokens (positions look alike within a short token's reach) and walk their long tokens one
by one. Every token's mask bit is checked against ``accept_token`` on a fork, at positions all
along such strings (escapes, multi-byte characters, long runs of spaces that make long tokens,
strings exactly at their bounds, the end of a 256-character chunk), with both tokenizers, on a
first pass (short masks being built) and a second pass (short masks and state masks cached).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from grammar_support import assert_bits_match_acceptance, hf_tokenizer, mask_bits, tokenizer_info

from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.ir import Grammar
from agent_infer.grammar.runtime.matcher import GrammarMatcher

# `short` stays a counted Repeat (inline), `long` and `wide` become power-of-two blocks.
SCHEMA = {
    "type": "object",
    "properties": {
        "short": {"type": "string", "minLength": 3, "maxLength": 24},
        "long": {"type": "string", "maxLength": 64},
        "wide": {"type": "string", "minLength": 40, "maxLength": 70},
    },
    "required": ["short", "long", "wide"],
    "additionalProperties": False,
}
DOCS = [
    {
        "short": 'a\\"b\u00e9\u65e5\U0001f600\n\u0001xyz',
        "long": 'Saint-R\u00e9my                        de-Provence \\ "q" \u6771\u4eac',
        "wide": "x" * 10 + "                ----------------" + "\u00e9" * 22,
    },
    {
        "short": "abc",
        "long": "",
        "wide": "w" * 70,
    },
]


def _check_doc(compiled: object, ids: list[int], stride: int, offset: int) -> int:
    """Checks every token's bit at every ``stride``-th position; returns the positions checked."""
    info = compiled.tokenizer_info  # type: ignore[attr-defined]
    m = GrammarMatcher(compiled)  # type: ignore[arg-type]
    checked = 0
    for pos, tid in enumerate(ids):
        if pos % stride == offset:
            bits = mask_bits(m, info.vocab_size)
            assert_bits_match_acceptance(m, bits, pos)
            checked += 1
        assert m.accept_token(tid), pos
    assert m.can_terminate()
    return checked


@pytest.mark.parametrize("tokenizer", ["smollm2", "deepseek"])
def test_bounded_string_masks_exact(tokenizer: str) -> None:
    info = tokenizer_info(tokenizer)
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(SCHEMA, whitespace="compact")
    )
    tok = hf_tokenizer(tokenizer)
    for doc in DOCS:
        text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
        # One character per step: the matcher visits every position of the bounded strings.
        ids = [t for ch in text for t in tok.encode(ch, add_special_tokens=False).ids]
        assert _check_doc(compiled, ids, 3, 0) > 20
        assert _check_doc(compiled, ids, 3, 1) > 20  # a second pass, pieces now cached


@pytest.mark.parametrize("tokenizer", ["smollm2", "deepseek"])
def test_bounded_string_lengths_enforced(tokenizer: str) -> None:
    """A string at its maximum takes only the closing quote; below its minimum, no quote."""
    info = tokenizer_info(tokenizer)
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema({"type": "string", "minLength": 40, "maxLength": 70}, whitespace="compact")
    )
    for n, ok in ((39, False), (40, True), (70, True), (71, False)):
        m = GrammarMatcher(compiled)
        assert m.accept_string('"' + "\u00e9" * n + '"') is ok, n
    m = GrammarMatcher(compiled)
    assert m.accept_string('"' + "ab" * 35)
    bits = mask_bits(m, info.vocab_size)
    allowed = [info.token_bytes(t) for t in np.flatnonzero(bits)]
    assert allowed and all(b.startswith(b'"') for b in allowed), allowed[:10]


@pytest.mark.parametrize("tokenizer", ["smollm2", "deepseek"])
def test_chunked_string_masks_exact(tokenizer: str) -> None:
    """Around the end of a 256-character chunk (1 + 256 characters in) and at the bound."""
    info = tokenizer_info(tokenizer)
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema({"type": "string", "minLength": 1, "maxLength": 300}, whitespace="compact")
    )
    tok = hf_tokenizer(tokenizer)
    value = ("word \u00e9\u65e5 \n " * 40)[:240] + '\u00e9\t"' * 6 + "-" * 42
    assert len(value) == 300
    text = json.dumps(value, ensure_ascii=False)
    ids: list[int] = []
    ends: list[int] = []
    for i, ch in enumerate(text):
        piece = tok.encode(ch, add_special_tokens=False).ids
        ids += piece
        ends += [i] * len(piece)
    # Escapes make the text longer than the value: the chunk ends (257 characters in) at text
    # index 294.
    window = {k for k, e in enumerate(ends) if 276 <= e <= 312 or e >= len(text) - 3}
    assert len(window) > 30
    m = GrammarMatcher(compiled)
    for pos, tid in enumerate(ids):
        if pos in window:
            bits = mask_bits(m, info.vocab_size)
            assert_bits_match_acceptance(m, bits, pos)
        assert m.accept_token(tid), pos
    assert m.can_terminate()


# Bounded strings among many optional members (a Snowplow event): a token crossing a string's end
# may go on into any of the next keys, so dozens of tokens are uncertain at every position and the
# pushdown walk checks them. A bounded string is a chain of rules called in tail position, whose
# frames the walk must not stack one per byte (it gave up past 64, leaving the check to Earley).
WALK_SCHEMA = {
    "type": "object",
    "properties": {
        **{
            f"br_{k}": {"type": ["string", "null"], "maxLength": n}
            for k, n in zip("abcdefgh", (255, 50, 12, 3) * 2)
        },
        "curie": {"type": "string", "pattern": "^([a-z0-9-]+):([a-z0-9.-]+)$", "maxLength": 60},
    },
    "additionalProperties": False,
}
WALK_DOCS = [
    {"br_a": "my_app_with_a_long_name", "br_b": "Firefox", "br_e": "en-US", "curie": "acme-blog:article.v1"}
]


@pytest.mark.parametrize("tokenizer", ["smollm2", "deepseek"])
def test_bounded_strings_among_optional_members_masks_exact_with_the_walk(tokenizer: str) -> None:
    from agent_infer.native import load_native

    native = load_native()
    info = tokenizer_info(tokenizer)
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(WALK_SCHEMA, whitespace="compact")
    )
    tok = hf_tokenizer(tokenizer)
    native.grammar_profile(True)
    native.grammar_profile()
    try:
        for doc in WALK_DOCS:
            text = json.dumps(doc, separators=(",", ":"))
            ids = [t for ch in text for t in tok.encode(ch, add_special_tokens=False).ids]
            assert _check_doc(compiled, ids, 2, 0) > 20
            assert _check_doc(compiled, ids, 2, 1) > 20
        profile = native.grammar_profile()
    finally:
        native.grammar_profile(False)
    assert profile.get("check_walk", (0, 0))[1] > 0, profile
