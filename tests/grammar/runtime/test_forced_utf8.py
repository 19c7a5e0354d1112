"""Forced tokens when the last accepted token ended inside a multi-byte UTF-8 character."""

from __future__ import annotations

import pytest
from grammar_support import tokenizer_info

from agent_infer.grammar import Grammar, GrammarCompiler, GrammarMatcher


@pytest.mark.parametrize("name", ["smollm2", "deepseek"])
def test_forced_tokens_after_a_partial_character(name: str) -> None:
    info = tokenizer_info(name)
    matcher = GrammarMatcher(GrammarCompiler(info).compile(Grammar.from_regex("日本語-x")))
    first_byte = "日".encode()[:1]
    byte_token = next(t for t in range(info.vocab_size) if info.token_bytes(t) == first_byte)
    assert matcher.accept_token(byte_token)
    data, _ = matcher.find_forced_bytes()
    assert data.startswith("日".encode()[1:])
    # Mid-character: nothing is forced, and the forced text starts at the next whole character.
    assert matcher.forced_tokens() == []
    assert matcher.find_forced_string() == "本語-x"
