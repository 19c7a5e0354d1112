"""Attention DP + expert parallelism on a tiny random DeepSeek V3 checkpoint, 2 real rank processes:
greedy, seeded and schema-constrained outputs bit-identical to one process, across EPLB
rebalances in mid-generation, with the expert imbalance dropping; requests spread over ranks."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel, Field

from agent_infer import LLM, SamplingParams
from agent_infer.errors import InvalidRequestError, RankFailedError
from agent_infer.parallel import DataParallelEngine
from agent_infer.parallel.eplb import balanced_placement
from agent_infer.parallel.load_stats import save_profile

pytest.importorskip("transformers")

PROMPTS = [
    "Read the following sentence and name the person: Ada wrote three books about engines.",
    "Another one, please",
    "List three colours.",
    "What is two plus two?",
    "Write a haiku about tea.",
    "Say hello.",
]


class Person(BaseModel):
    name: str = Field(max_length=8)
    books: int


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=2),
        SamplingParams(temperature=0.9, seed=7, max_tokens=24, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=40, structured=Person, close_on_length=True),
        SamplingParams(temperature=0.7, seed=3, max_tokens=20, structured={"enum": ["red", "green", "blue"]}),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True),
    ]


@pytest.fixture(scope="module")
def single(model_dir: str) -> list:
    llm = LLM(model=model_dir, kv_cache_memory_bytes=32 * 1024 * 1024)
    return llm.generate(PROMPTS, _params())


def _dp2_ep(model_dir: str) -> LLM:
    """Two data-parallel ranks with experts split over them, 2 redundant slots, a rebalance every 4 steps."""
    return LLM(
        model=model_dir,
        kv_cache_memory_bytes=32 * 1024 * 1024,
        data_parallel_size=2,
        expert_parallel=True,
        redundant_experts=2,
        eplb_interval=4,
        eplb_window=64,
        collective_timeout_s=60.0,
    )


def test_dp2_expert_parallel_with_rebalances_is_bit_identical(
    model_dir: str, single: list, tmp_path: Path
) -> None:
    llm = _dp2_ep(model_dir)
    try:
        engine = llm.engine
        assert isinstance(engine, DataParallelEngine)
        got = llm.generate(PROMPTS, _params())
        metrics = engine.collect_metrics()
        profile = engine.save_load_profile(str(tmp_path / "load.json"))
    finally:
        llm.close()
    assert profile.shape == (2, 8) and profile[:, :2].sum() > profile[:, 2:].sum() / 3  # 0 and 1 are hot
    for want, out in zip(single, got):
        assert out.outputs[0].token_ids == want.outputs[0].token_ids
        assert out.outputs[0].text == want.outputs[0].text
        assert out.outputs[0].logprobs == want.outputs[0].logprobs  # the float bits, not only the choice
    assert got[0].outputs[0].logprobs
    assert isinstance(got[2].outputs[0].parsed, Person) or got[2].outputs[0].finish_reason == "length"
    json.loads(got[3].outputs[0].text)
    m0 = metrics[0]
    assert m0 is not None and m0.rebalances >= 2
    before, after = m0.imbalance_history[0]  # the first rebalance replaces the contiguous placement
    assert after < before
    assert min(m0.total_tokens_per_rank) > 0  # both ranks served requests
    assert engine.generated_tokens[0] > 0 and engine.generated_tokens[1] > 0
    assert m0.dispatch_bytes > 0
    assert m0.packed_slots >= 5 * len(m0.placements)  # the ranks run the packed native kernels


def test_dp2_expert_parallel_on_the_torch_kernels_is_bit_identical(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``AGENT_INFER_NATIVE_LINEAR=0``: one process and every rank (which inherit the setting) on the
    torch kernels."""
    monkeypatch.setenv("AGENT_INFER_NATIVE_LINEAR", "0")
    one = LLM(model=model_dir, kv_cache_memory_bytes=32 * 1024 * 1024)
    assert one.engine.runner.model.kernels.name != "packed-float"
    want = one.generate(PROMPTS[:4], _params()[:4])
    llm = _dp2_ep(model_dir)
    try:
        got = llm.generate(PROMPTS[:4], _params()[:4])
        metrics = llm.engine.collect_metrics()  # type: ignore[attr-defined]
    finally:
        llm.close()
    for w, out in zip(want, got):
        assert out.outputs[0].token_ids == w.outputs[0].token_ids
        assert out.outputs[0].logprobs == w.outputs[0].logprobs
    assert all(m is not None and m.rebalances >= 1 and m.packed_slots == 0 for m in metrics.values())


def test_data_parallel_without_expert_parallel_matches(model_dir: str, single: list) -> None:
    llm = LLM(model=model_dir, kv_cache_memory_bytes=32 * 1024 * 1024, data_parallel_size=2)
    engine = llm.engine
    assert isinstance(engine, DataParallelEngine)
    try:
        got = llm.generate(PROMPTS[:4], _params()[:4])
        engine.add_request("long", PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True))
        engine.abort("long")
        ends: list = []
        deadline = time.monotonic() + 30
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            ends += [out for out in engine.step() if out.finished]
        with pytest.raises(InvalidRequestError, match="prompt"):
            engine.add_request("bad", [], SamplingParams())  # the rank's own check, raised here
    finally:
        llm.close()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in ends] == [("long", "abort")]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in single[:4]]


@pytest.mark.parametrize(
    ("expert_parallel", "cp_threshold"), [(True, 0), (False, 0), (False, 64)], ids=["ep", "dp-only", "dp-cp"]
)
def test_a_killed_rank_fails_its_requests_with_a_typed_error(
    model_dir: str, expert_parallel: bool, cp_threshold: int, tmp_path: Path
) -> None:
    """Under expert parallelism the ranks also start from a static placement of a saved profile;
    with context-parallel prefill the ranks share collectives, so one death fails them all."""
    profile = torch.tensor([[900, 50, 10, 10, 10, 10, 10, 10], [10, 10, 10, 10, 10, 10, 500, 400]])
    save_profile(tmp_path / "load.json", profile)
    ep_options = (
        dict(eplb_profile=str(tmp_path / "load.json"), redundant_experts=2) if expert_parallel else {}
    )
    llm = LLM(
        model=model_dir,
        kv_cache_memory_bytes=32 * 1024 * 1024,
        data_parallel_size=2,
        expert_parallel=expert_parallel,
        collective_timeout_s=30.0,
        cp_prefill_threshold=cp_threshold,
        **ep_options,
    )
    engine = llm.engine
    assert isinstance(engine, DataParallelEngine)
    try:
        if expert_parallel:
            placed = engine.collect_metrics()[0]
            assert placed is not None
            want = [balanced_placement(row.tolist(), 2, 5, num_groups=4).slots for row in profile.float()]
            assert placed.placements == want and placed.placements[0].count(0) >= 2  # hot expert 0 replicated
        params = SamplingParams(temperature=0.0, max_tokens=4000, ignore_eos=True)
        for i in range(4):
            engine.add_request(f"r{i}", PROMPTS[i], params)
        assert engine.requests_per_rank() == [2, 2]
        while not any(out.outputs[0].token_ids for out in engine.step()):
            pass
        os.kill(engine.pids[1], signal.SIGKILL)
        finished = {}
        deadline = time.monotonic() + 60
        while engine.has_unfinished_requests() and time.monotonic() < deadline:
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert not engine.healthy
        failed = {i for i, out in finished.items() if out.outputs[0].finish_reason == "error"}
        # rank 1 held r1 and r3; under expert parallelism (or CP) rank 0 cannot go on without it
        assert failed == ({"r0", "r1", "r2", "r3"} if expert_parallel or cp_threshold else {"r1", "r3"})
        for i in failed:
            assert "RankFailedError: rank 1 exited" in (finished[i].outputs[0].error or "")
        with pytest.raises(RankFailedError, match="unhealthy"):
            engine.add_request("late", PROMPTS[0], params)
    finally:
        llm.close()
