"""The grammars of ``grammar_support`` walked along their example documents with a real tokenizer:
at every step the document's next token is allowed by the mask and accepted (the walk
``benchmarks/bench_grammar_core.py`` times)."""

from __future__ import annotations

import pytest
from grammar_support import GRAMMARS, INSTANCES, hf_tokenizer, tokenizer_info

from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask
from agent_infer.grammar.runtime.matcher import GrammarMatcher


@pytest.mark.parametrize("name", sorted(GRAMMARS))
def test_every_instance_token_is_allowed_and_accepted(name: str) -> None:
    info = tokenizer_info("deepseek")
    tok = hf_tokenizer("deepseek")
    matcher = GrammarMatcher(GrammarCompiler(info, cache_enabled=False).compile(GRAMMARS[name]()))
    bitmask = allocate_token_bitmask(1, info.vocab_size)
    steps = 0
    for text in INSTANCES[name]:
        matcher.reset()
        for tid in tok.encode(text, add_special_tokens=False).ids:
            matcher.fill_next_token_bitmask(bitmask)
            assert (int(bitmask[0, tid // 32]) >> (tid % 32)) & 1, (name, text, steps)
            assert matcher.accept_token(tid)
            steps += 1
        assert matcher.can_terminate()
    assert steps > 0
