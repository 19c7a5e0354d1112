"""MTP drafts in the engine on a tiny DeepSeek V3 with an MTP layer: lossless (greedy and seeded,
alone, in mixed batches, constrained, under preemption), counted per source, and its controls."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from deepseek_support import BYTE_VOCAB, save_tiny, save_tiny_mtp, write_byte_tokenizer

from agent_infer import LLM, SamplingParams
from agent_infer.errors import ConfigError, InvalidRequestError

pytest.importorskip("transformers")

KV = 8 << 20  # the tiny model needs little cache; the default would allocate 512 MiB per engine

PROMPTS = [
    "Hello there, how are you",
    "The quick brown fox jumps",
    "abc abc abc abc",
    "1, 2, 3, 4, 5",
    '{"name": "Ada", "age": 36}',
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny V3 whose MTP layer predicts its own next-next token often (see make_predictable)."""
    path = tmp_path_factory.mktemp("tiny_v3_mtp")
    save_tiny_mtp(path, predictable=True, vocab_size=BYTE_VOCAB, eos_token_id=256)
    write_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def engines(folder: Path) -> dict[str, LLM]:
    return {
        source: LLM(model=str(folder), speculative_source=source, kv_cache_memory_bytes=KV)
        for source in ("off", "mtp", "ngram", "auto")
    }


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_auto_uses_mtp_where_the_checkpoint_has_it(engines: dict[str, LLM]) -> None:
    auto = engines["auto"].engine
    assert auto.speculator is not None and auto.speculator.mtp is not None
    assert engines["ngram"].engine.speculator.mtp is None  # type: ignore[union-attr]


@pytest.mark.parametrize("source", ["mtp", "auto", "ngram"])
def test_greedy_equals_plain_decoding_alone_and_batched(engines: dict[str, LLM], source: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    plain = _tokens(engines["off"].generate(PROMPTS, params))
    alone = [engines[source].generate([p], params)[0] for p in PROMPTS]
    outs = engines[source].generate(PROMPTS, params)
    assert _tokens(alone) == plain
    assert _tokens(outs) == plain
    # ``auto`` drafts where drafting pays by the costs it measures on this machine: alone it does;
    # in a batch of this tiny model a draft's own overhead may outweigh what it keeps.
    counted = outs if source != "auto" else outs + alone
    drafted = sum(o.metrics.num_draft_tokens for o in counted)
    accepted = sum(o.metrics.num_accepted_draft_tokens for o in counted)
    assert drafted > 0 and 0 < accepted <= drafted


def test_mtp_metrics_per_source(engines: dict[str, LLM]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    outs = engines["mtp"].generate(PROMPTS, params)
    for out in outs:
        m = out.metrics
        stats = m.draft_sources
        assert set(stats) <= {"mtp", "forced"} and "mtp" in stats
        mtp = stats["mtp"]
        assert mtp.drafted == m.num_draft_tokens and mtp.accepted == m.num_accepted_draft_tokens
        assert mtp.verifications > 0
        assert mtp.mean_accepted_length == pytest.approx(mtp.accepted / mtp.verifications)


def test_mixed_batch_of_sources_lengths_and_sampling(engines: dict[str, LLM]) -> None:
    """Greedy rows with MTP, prompt lookup, no drafts and short drafts, next to seeded sampled rows:
    every row's tokens equal the same request decoded without drafts."""
    kinds: list[SamplingParams] = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, speculative_source="ngram"),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, speculative_source="off"),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, speculative_tokens=2),
        SamplingParams(temperature=0.8, seed=11, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=40, ignore_eos=True),
    ]
    llm = engines["auto"]
    engine = llm.engine
    for i, params in enumerate(kinds):
        engine.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)], params)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.outputs[0].token_ids
    for i, params in enumerate(kinds):
        want = engines["off"].generate([PROMPTS[i % len(PROMPTS)]], params)[0].outputs[0].token_ids
        assert got[f"r{i}"] == want, i


def test_seeded_sampling_is_reproducible_with_mtp_drafts(engines: dict[str, LLM]) -> None:
    params = [SamplingParams(temperature=t, seed=s, max_tokens=40) for t in (0.5, 1.0) for s in (1, 2)]
    for p in params:
        want = _tokens(engines["off"].generate(PROMPTS[:2], p))
        assert _tokens(engines["mtp"].generate(PROMPTS[:2], p)) == want


def test_structured_outputs_with_mtp_drafts(engines: dict[str, LLM]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=60, structured=SCHEMA)
    plain = engines["off"].generate(PROMPTS, params)
    outs = engines["mtp"].generate(PROMPTS, params)
    assert _tokens(outs) == _tokens(plain)
    for out in outs:
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_preemption_and_prefix_cache_keep_outputs(folder: Path, engines: dict[str, LLM]) -> None:
    """A pool too small for the batch preempts and recomputes; the MTP cache is rebuilt from the
    recompute, and prefix-cached blocks are reused: outputs stay those of plain decoding."""
    small = LLM(model=str(folder), speculative_source="mtp", num_kv_blocks=24, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [p + " and more" for p in PROMPTS]
    plain = _tokens(engines["off"].generate(prompts, params))
    outs = small.generate(prompts, params)
    assert [o.outputs[0].error for o in outs] == [None] * len(prompts)
    assert _tokens(outs) == plain
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    engines["mtp"].generate(prompts[:1], params)
    again = engines["mtp"].generate(prompts[:1], params)[0]
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == plain[0]


def test_mtp_on_a_checkpoint_without_mtp_layers_is_a_config_error(tmp_path: Path) -> None:
    save_tiny(tmp_path, vocab_size=BYTE_VOCAB, eos_token_id=256)
    write_byte_tokenizer(tmp_path)
    with pytest.raises(ConfigError, match="speculative_source='mtp'"):
        LLM(model=str(tmp_path), speculative_source="mtp", kv_cache_memory_bytes=KV)
    llm = LLM(model=str(tmp_path), kv_cache_memory_bytes=KV)  # auto: prompt lookup only
    assert llm.engine.speculator is not None and llm.engine.speculator.mtp is None
    with pytest.raises(InvalidRequestError) as err:
        llm.generate(["hi"], SamplingParams(max_tokens=2, speculative_source="mtp"))
    assert err.value.field == "speculative_source"


def test_environment_picks_the_source(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_INFER_SPECULATIVE_SOURCE", "ngram")
    assert LLM(model=str(folder), kv_cache_memory_bytes=KV).engine.speculator.mtp is None  # type: ignore[union-attr]
    monkeypatch.setenv("AGENT_INFER_SPECULATIVE_SOURCE", "sometimes")
    with pytest.raises(ConfigError, match="AGENT_INFER_SPECULATIVE_SOURCE"):
        LLM(model=str(folder), kv_cache_memory_bytes=KV)


def test_chunked_prefill_fills_the_mtp_cache(folder: Path, engines: dict[str, LLM]) -> None:
    """A long prompt prefilled in 8-token chunks while another request decodes: the chunks' rows
    reach the MTP module once their next tokens are known, and its drafts are accepted."""
    llm = LLM(
        model=str(folder),
        speculative_source="mtp",
        max_prefill_tokens_while_decoding=8,
        kv_cache_memory_bytes=KV,
    )
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    long_prompt = " ".join(PROMPTS)
    engine = llm.engine
    engine.add_request("short", PROMPTS[0], params)
    engine.step()  # the short request is decoding before the long one arrives
    engine.add_request("long", long_prompt, params)
    got: dict[str, Any] = {}
    chunks = 0
    table: list[int] = []
    caught_up = -1
    while engine.has_unfinished_requests():
        seq = engine.requests.get("long")
        if seq is not None:
            chunks += 0 < seq.num_computed_tokens < seq.num_prompt_tokens
            table = list(seq.block_table)
            caught_up = seq.spec.mtp_pos if seq.spec.mtp_pos is not None else caught_up
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out
    assert chunks >= 2
    for rid, prompt in (("short", PROMPTS[0]), ("long", long_prompt)):
        want = engines["off"].generate([prompt], params)[0].outputs[0].token_ids
        assert got[rid].outputs[0].token_ids == want
    assert got["long"].metrics.num_accepted_draft_tokens > 0
    # The module's cache entries of every caught-up position equal one pass over the whole text.
    out = got["long"]
    _assert_mtp_cache_matches(llm, out.prompt_token_ids + out.outputs[0].token_ids, table, caught_up)


def _assert_mtp_cache_matches(llm: LLM, tokens: list[int], table: list[int], last: int) -> None:
    from agent_infer.model.families.deepseek_v3 import DeepseekV3ForCausalLM
    from agent_infer.model.kv_cache import KVCache
    from agent_infer.model.layers.attention import AttentionMetadata, PagedAttention

    engine = llm.engine
    model = engine.runner.model
    drafter = engine.speculator.mtp  # type: ignore[union-attr]
    assert isinstance(model, DeepseekV3ForCausalLM) and drafter is not None and last > 20
    n, bs = last + 1, engine.config.block_size
    blocks = list(range((n + 1 + bs - 1) // bs))
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n + 1)])
    cache = KVCache.allocate(model.config, len(blocks), bs, model.device, model.dtype)
    meta = AttentionMetadata([0, n + 1], [n + 1], [blocks], slots, bs)
    with torch.no_grad():
        hidden = model(torch.tensor(tokens[: n + 1]), torch.arange(n + 1), meta, cache)
        pool = torch.zeros(len(blocks) * bs, int(drafter.pool.shape[1]))
        meta = AttentionMetadata([0, n], [n], [blocks], slots[:n], bs)
        plan = PagedAttention().plan(meta, n, pool.shape[0], model.device)
        layer = model.mtp_layers()[0]
        layer.forward(
            hidden[:n],
            torch.tensor(tokens[1 : n + 1]),
            model.embed,
            model.rotary.at(torch.arange(n)),
            pool,
            plan,
        )
    got = drafter.pool[torch.tensor([table[p // bs] * bs + p % bs for p in range(n)])]
    assert (got - pool[:n]).abs().max().item() <= 1e-4
