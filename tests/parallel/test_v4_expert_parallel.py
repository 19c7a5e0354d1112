"""Expert parallelism on DeepSeek V4's MoE (the trained tiny V4: a hash-routed first layer, every
expert clamped by swiglu_limit): DP=2 + EP outputs are bit-identical to one process, greedy,
seeded and constrained, across EPLB rebalances whose weight moves read the experts from the
checkpoint instead of a peer.

Drafting is off on both sides: V4's compressed attention runs a verification chunk's rows in one
torch matmul (``compressed_attention.QUERY_BLOCK``), whose bits differ from decoding those rows one
at a time by about 1e-6, and whether a step carries a draft depends on measured step costs (the
``auto`` source), so a seeded sample at a near-tie could follow the timing rather than the expert
layout this test is about (docs/models.md, "Batch invariance")."""

from __future__ import annotations

import json

from pydantic import BaseModel

from agent_infer import LLM, SamplingParams
from agent_infer.model.loading.hf import hf_config
from agent_infer.parallel import DataParallelEngine

PROMPTS = [
    '{"name": "Ada", "books": 3, "tags": ["',
    "Write a JSON object describing a cat.",
    '[{"id": 1, "ok": true}, {"id": 2, "ok": ',
    "List three colours.",
    '{"city": "Oslo", "population": ',
]


class Pet(BaseModel):
    name: str
    age: int


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=5, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, structured=Pet, close_on_length=True),
        SamplingParams(temperature=0.7, seed=2, max_tokens=12, structured={"enum": ["red", "green", "blue"]}),
    ]


def test_v4_dp2_expert_parallel_is_bit_identical_with_file_sourced_moves(trained_v4: str) -> None:
    spec = hf_config(trained_v4).deepseek_v4
    assert spec is not None and spec.hash_layers[0] and spec.swiglu_limit  # what this test is about
    single = LLM(model=trained_v4, kv_cache_memory_bytes=32 * 1024 * 1024, speculative_source="off").generate(
        PROMPTS, _params()
    )
    llm = LLM(
        model=trained_v4,
        kv_cache_memory_bytes=32 * 1024 * 1024,
        data_parallel_size=2,
        expert_parallel=True,
        redundant_experts=2,
        eplb_interval=3,
        eplb_window=32,
        eplb_weight_source="file",
        collective_timeout_s=60.0,
        speculative_source="off",
    )
    try:
        engine = llm.engine
        assert isinstance(engine, DataParallelEngine)
        got = llm.generate(PROMPTS, _params())
        metrics = engine.collect_metrics()
    finally:
        llm.close()
    for want, out in zip(single, got):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert Pet.model_validate_json(got[3].outputs[0].text) == got[3].outputs[0].parsed
    assert json.loads(got[4].outputs[0].text) in ("red", "green", "blue")
    for rank, m in metrics.items():
        assert m is not None and m.rebalances >= 2
        assert m.rebalance_bytes == 0  # nothing went through the peers
        slots = len(m.placements[0]) // 2
        for layer, placement in enumerate(m.placements):
            # everything the rank holds now, including what the moves brought, came from the file
            assert set(placement[rank * slots : (rank + 1) * slots]) <= set(m.experts_read[layer])
