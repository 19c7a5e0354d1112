"""Grammar core: the opt-in mask-time profile (``agent_infer._native.grammar_profile``).

``benchmarks/profile_mask_tail.py`` reads it after every step to attribute slow steps to a kind
of work; here the kinds it reports are checked against what a first fill on a fresh tokenizer
cache must do, and a disabled profile must report nothing.
"""

from __future__ import annotations

from grammar_support import tokenizer_info

from agent_infer import _native
from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.ir import Grammar
from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask
from agent_infer.grammar.runtime.matcher import GrammarMatcher

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
KINDS = {
    "state_key",
    "short_key",
    "local_key",
    "region_walk",
    "region_exits",
    "short_fill",
    "put_short",
    "pieces",
    "pieces_walk",
    "full_calls",
    "full_plain",
    "check_walk",
    "check_earley",
    "context_key",
    "twin",
    "content",
}


def _decode(info: TokenizerInfo, text: str) -> None:
    """Compiles SCHEMA against ``info`` and fills the mask before every byte of ``text``."""
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(SCHEMA, whitespace="compact")
    )
    m = GrammarMatcher(compiled)
    bitmask = allocate_token_bitmask(1, info.vocab_size)
    for ch in text:
        m.fill_next_token_bitmask(bitmask)
        assert m.accept_string(ch)


def test_profile_reports_first_visits_only_when_enabled() -> None:
    base = tokenizer_info("smollm2")

    def fresh() -> TokenizerInfo:
        # Its own mask cache: every state of the grammar is new to it.
        return TokenizerInfo(
            list(base.decoded_vocab), vocab_size=base.vocab_size, eos_token_ids=base.eos_token_ids
        )

    text = '{"name":"Ada Lovelace","age":36}'
    try:
        _native.grammar_profile(False)
        _native.grammar_profile()  # drop what earlier tests on this thread left
        _decode(fresh(), text)
        assert _native.grammar_profile() == {}
        _native.grammar_profile(True)
        _decode(fresh(), text)
        prof = _native.grammar_profile()
    finally:
        _native.grammar_profile(False)
    assert set(prof) <= KINDS
    # Each first visit names its state, and on a fresh cache some states walk tokens.
    ns, calls = prof["state_key"]
    assert calls > 0 and ns > 0
    walks = {"full_plain", "full_calls", "pieces_walk", "region_walk", "region_exits"}
    assert sum(prof[k][1] for k in walks & set(prof)) > 0
    assert all(c >= 0 and n >= 0 for n, c in prof.values())
    # Reading resets the counters.
    assert _native.grammar_profile() == {}
