"""The compiler's warm-up of a tokenizer's tables (``compile/warmup.py``): the first GrammarCompiler
for a TokenizerInfo fills the native token-class cache for the common JSON string contents, once
per tokenizer, and a string state's first mask then reads that cache."""

from __future__ import annotations

import numpy as np
from grammar_support import tokenizer_info

from agent_infer.grammar import Grammar, GrammarCompiler, GrammarMatcher, TokenizerInfo
from agent_infer.grammar.compile import warmup


def _fresh(base: TokenizerInfo) -> TokenizerInfo:
    return TokenizerInfo(base.decoded_vocab, vocab_size=base.vocab_size, eos_token_ids=base.eos_token_ids)


def test_the_first_compiler_warms_each_tokenizer_once() -> None:
    info = _fresh(tokenizer_info("smollm2"))
    assert info._native.cache_entries() == 0  # building the tables computes no masks
    GrammarCompiler(info, cache_enabled=False)
    entries, size = info._native.cache_entries(), info._native.cache_bytes()
    assert entries > 0 and size > 0
    GrammarCompiler(info, max_states=10)  # warmed already: nothing recomputed, limits not used
    assert (info._native.cache_entries(), info._native.cache_bytes()) == (entries, size)


def test_a_warmed_string_context_adds_no_entries_at_its_first_mask() -> None:
    info = _fresh(tokenizer_info("smollm2"))
    compiler = GrammarCompiler(info, cache_enabled=False)
    schema, prefixes = warmup.STRING_CONTEXTS[0]
    entries = info._native.cache_entries()
    m = GrammarMatcher(compiler.compile(Grammar.from_json_schema(schema, whitespace="compact")))
    assert m.accept_string(prefixes[0])
    m.fill_next_token_bitmask(np.zeros((1, (info.vocab_size + 31) // 32), np.int32))
    assert info._native.cache_entries() == entries
