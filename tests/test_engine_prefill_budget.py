"""The per-step token budget: long prompts are prefilled in small chunks while other requests decode."""

from __future__ import annotations

import pytest

from agent_infer.engine.block_manager import BlockManager
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.scheduler import Scheduler, SchedulerOutput
from agent_infer.engine.sequence import Sequence
from agent_infer.errors import ConfigError
from agent_infer.sampling_params import SamplingParams


def _seq(name: str, n: int, max_tokens: int = 1000) -> Sequence:
    return Sequence(
        name, [(7 * i + 31 * ord(name[-1])) % 500 for i in range(n)], SamplingParams(max_tokens=max_tokens)
    )


def _step(sched: Scheduler, out: SchedulerOutput) -> None:
    """Advance like the engine: every sequence whose chunk reaches its end gets a new token."""
    sched.advance(out)
    for item in out.scheduled:
        if item.samples:
            item.seq.append_token(1)


def _shares(out: SchedulerOutput) -> dict[str, int]:
    return {i.seq.request_id: i.num_new_tokens for i in out.scheduled}


def _scheduler(**config: int) -> Scheduler:
    cfg = EngineConfig(block_size=16, num_kv_blocks=512, speculative_tokens=0, **config)
    return Scheduler(cfg, BlockManager(512, 16))


def test_long_prompt_is_chunked_small_while_others_decode() -> None:
    sched = _scheduler(max_num_batched_tokens=2048, max_prefill_tokens_while_decoding=32)
    streams = [_seq(f"s{i}", 20) for i in range(3)]
    for s in streams:
        sched.add(s)
    _step(sched, sched.schedule())  # the short prompts prefill together; now they decode
    long = _seq("long", 3000)
    sched.add(long)
    steps = 0
    while long.num_computed_tokens < long.num_prompt_tokens:
        out = sched.schedule()
        shares = _shares(out)
        # Every decoding stream gets its token in every step, and the prompt only a small chunk.
        assert all(shares[s.request_id] == 1 for s in streams)
        assert shares["long"] <= 32
        assert out.num_tokens <= 32 + len(streams)
        _step(sched, out)
        steps += 1
    assert steps == -(-3000 // 32)


def test_without_decodes_a_prompt_gets_the_whole_budget() -> None:
    sched = _scheduler(max_num_batched_tokens=2048, max_prefill_tokens_while_decoding=32)
    long = _seq("long", 3000)
    sched.add(long)
    out = sched.schedule()
    assert _shares(out) == {"long": 2048}
    _step(sched, out)
    assert _shares(sched.schedule()) == {"long": 3000 - 2048}


def test_admissions_share_the_prefill_budget() -> None:
    sched = _scheduler(max_num_batched_tokens=2048, max_prefill_tokens_while_decoding=32)
    sched.add(_seq("s", 10))
    _step(sched, sched.schedule())
    for name in ("a", "b", "c"):
        sched.add(_seq(name, 20))
    out = sched.schedule()
    assert _shares(out) == {"s": 1, "a": 20, "b": 12}
    _step(sched, out)
    # "b" continues its prompt before "c" starts; "a" now decodes.
    assert _shares(sched.schedule()) == {"s": 1, "a": 1, "b": 8, "c": 20}


def test_prefill_budget_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="max_prefill_tokens_while_decoding"):
        EngineConfig(max_prefill_tokens_while_decoding=0)
