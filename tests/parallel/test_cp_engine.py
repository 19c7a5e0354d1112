"""Context-parallel prefill in the engine (the trained tiny V3, 2 real rank processes, with and
without expert parallelism): prompts past the threshold are prefilled over both ranks and decoded
by their owner, greedy and schema-constrained outputs equal one process (a short seeded request,
not prefilled over the ranks, bit for bit), a prompt found in the prefix cache is not prefilled
again, an abort while a job is pending ends that request alone, and the prefills show on /metrics."""

from __future__ import annotations

import time

import pytest

from agent_infer import LLM, SamplingParams
from agent_infer.model.loader import load_model
from agent_infer.parallel import DataParallelEngine
from agent_infer.parallel.cp_engine import PrefillStats
from agent_infer.parallel.expert_loading import resident_weight_bytes
from agent_infer.parallel.serving import ServedDataParallel

THRESHOLD = 100
ITEMS = [f'{{"id": {i}, "name": "item{i}", "tags": ["a", "b"]}},' for i in range(25)]
LONG = "Return the JSON list: [" + " ".join(ITEMS)
MEDIUM = "Describe: " + " ".join(ITEMS[:8])
PROMPTS = [LONG, "Say hello.", MEDIUM]
SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=8),  # short: no CP, bit-identical
        SamplingParams(temperature=0.0, max_tokens=20, structured=SCHEMA, close_on_length=True),
    ]


@pytest.fixture(scope="module")
def single(trained_v3: str) -> list:
    return LLM(model=trained_v3, kv_cache_memory_bytes=32 * 1024 * 1024).generate(PROMPTS, _params())


def _prefill_stats(engine: DataParallelEngine, want: int | None = None) -> dict[int, PrefillStats]:
    """The ranks' context-parallel counts: once each reports ``want`` prefills (at most 10 s), or
    with None the reports of the next second (ranks report every 0.25 s)."""
    deadline = time.monotonic() + (10 if want is not None else 1)
    while True:
        engine.step()
        stats = {r: s["cp_prefill"] for r, s in engine.rank_status.items()}
        done = want is not None and len(stats) == 2 and all(s.prefills >= want for s in stats.values())
        if done or time.monotonic() > deadline:
            return stats


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["dp", "dp-ep"])
def test_long_prompts_prefill_over_the_ranks_and_decode_on_their_owner(
    trained_v3: str, single: list, expert_parallel: bool
) -> None:
    ep = dict(expert_parallel=True, redundant_experts=2, eplb_interval=4) if expert_parallel else {}
    llm = LLM(
        model=trained_v3,
        kv_cache_memory_bytes=32 * 1024 * 1024,
        data_parallel_size=2,
        cp_prefill_threshold=THRESHOLD,
        collective_timeout_s=60.0,
        **ep,
    )
    engine = llm.engine
    assert isinstance(engine, DataParallelEngine)
    try:
        got = llm.generate(PROMPTS, _params())
        stats = _prefill_stats(engine, 2)
        again = llm.generate([LONG], _params()[:1])  # rank 0 holds its prefix: no third prefill
        after = _prefill_stats(engine)
        lines = "\n".join(ServedDataParallel(engine).prometheus_lines())
        held = {r: s["weight_bytes"] for r, s in engine.rank_status.items()}
        # Aborted while its prefill is announced or running: the others are unaffected.
        engine.add_request("gone", MEDIUM + " again", SamplingParams(max_tokens=4))
        engine.abort("gone")
        ends = []
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            ends += [out for out in engine.step() if out.finished]
        later = llm.generate(["Say hello."], _params()[1:2])
    finally:
        llm.close()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in ends] == [("gone", "abort")]
    assert later[0].outputs[0].token_ids == single[1].outputs[0].token_ids
    full = resident_weight_bytes(load_model(trained_v3).model)
    for n in held.values():  # under expert parallelism a rank holds 5 of the 8 experts of each layer
        assert n < full if expert_parallel else n == full
    for want, out in zip(single, got):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert again[0].outputs[0].token_ids == single[0].outputs[0].token_ids
    assert again[0].num_cached_tokens > THRESHOLD
    assert got[2].outputs[0].parsed is not None
    lengths = [len(got[0].prompt_token_ids), len(got[2].prompt_token_ids)]
    assert min(lengths) > THRESHOLD and len(got[1].prompt_token_ids) < THRESHOLD
    for rank in (0, 1):  # every rank took part in both prefills of the prompts minus their last token
        assert stats[rank].prefills == 2 and stats[rank].tokens >= sum(lengths) - 2
        assert after[rank].prefills == 2
    assert stats[0].owned + stats[1].owned == 2
    assert "agent_infer_parallel_cp_prefills_total 2" in lines
    assert 'agent_infer_parallel_cp_prefill_seconds_total{rank="1"}' in lines
