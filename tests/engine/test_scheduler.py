"""The Scheduler without a model: chunked prefill, admission, preemption, the prefill budget and drafts."""

from __future__ import annotations

import pytest
from engine_support import simulate_step

from agent_infer.engine.block_manager import BlockManager
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.scheduler import Scheduler, SchedulerOutput
from agent_infer.engine.sequence import FinishReason, Sequence, SequenceStatus
from agent_infer.engine.spec_state import INITIAL_ACCEPTANCE, SKIP_RECOVERY
from agent_infer.errors import ConfigError
from agent_infer.sampling_params import SamplingParams


def make_seq(name: str, tokens: list[int]) -> Sequence:
    return Sequence(name, tokens, SamplingParams(temperature=0.0, max_tokens=8))


def _seq(name: str, n: int, max_tokens: int = 1000) -> Sequence:
    return Sequence(
        name, [(7 * i + 31 * ord(name[-1])) % 500 for i in range(n)], SamplingParams(max_tokens=max_tokens)
    )


def _shares(out: SchedulerOutput) -> dict[str, int]:
    return {i.seq.request_id: i.num_new_tokens for i in out.scheduled}


def _scheduler(**config: int) -> Scheduler:
    cfg = EngineConfig(block_size=16, num_kv_blocks=512, speculative_tokens=0, **config)
    return Scheduler(cfg, BlockManager(512, 16))


def test_chunked_prefill_splits_long_prompt() -> None:
    config = EngineConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=8)
    bm = BlockManager(64, 4)
    sched = Scheduler(config, bm)
    seq = make_seq("long", list(range(20)))
    sched.add(seq)
    chunks = []
    while True:
        out = sched.schedule()
        assert out.num_tokens <= 8
        item = out.scheduled[0]
        chunks.append((item.start, item.num_new_tokens, item.samples))
        simulate_step(sched, out)
        if item.samples:
            break
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert seq.num_tokens == 21


def test_new_request_joins_running_batch() -> None:
    config = EngineConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=64)
    sched = Scheduler(config, BlockManager(64, 4))
    a = make_seq("a", list(range(5)))
    sched.add(a)
    simulate_step(sched, sched.schedule())
    b = make_seq("b", list(range(50, 56)))
    sched.add(b)
    out = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in out.scheduled] == [("a", 1), ("b", 6)]


def test_max_num_seqs_limits_admission() -> None:
    config = EngineConfig(block_size=4, num_kv_blocks=64, max_num_seqs=2)
    sched = Scheduler(config, BlockManager(64, 4))
    for i in range(3):
        sched.add(make_seq(str(i), [i, i + 1]))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and len(sched.waiting) == 1


def test_preemption_frees_newest_and_requeues_it_with_its_output() -> None:
    config = EngineConfig(block_size=4, num_kv_blocks=4, max_num_batched_tokens=64)
    bm = BlockManager(4, 4)
    sched = Scheduler(config, bm)
    old = make_seq("old", list(range(4)))
    new = make_seq("new", list(range(10, 18)))
    sched.add(old)
    sched.add(new)
    simulate_step(sched, sched.schedule())  # old: 1 block + 1 for its sampled token later
    assert bm.num_free_blocks == 1
    out = sched.schedule()  # old needs a 2nd block (token 5), new needs a 3rd (token 9): only 1 free
    assert [s.request_id for s in out.preempted] == ["new"]
    assert new.status is SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert new.num_tokens == 9  # its sampled token is kept and will be re-prefilled
    assert sched.waiting[0] is new and new.metrics.num_preemptions == 1
    assert [i.seq.request_id for i in out.scheduled] == ["old"]
    simulate_step(sched, out)
    sched.finish(old)
    out = sched.schedule()
    assert [(i.seq.request_id, i.start, i.num_new_tokens) for i in out.scheduled] == [("new", 8, 1)]


def test_sequence_larger_than_pool_fails_alone() -> None:
    config = EngineConfig(block_size=4, num_kv_blocks=2)
    sched = Scheduler(config, BlockManager(2, 4))
    big = make_seq("big", list(range(12)))
    sched.add(big)
    out = sched.schedule()
    assert out.failed == [big] and big.finish_reason is FinishReason.ERROR
    assert not sched.has_unfinished()


def test_long_prompt_is_chunked_small_while_others_decode() -> None:
    sched = _scheduler(max_num_batched_tokens=2048, max_prefill_tokens_while_decoding=32)
    streams = [_seq(f"s{i}", 20) for i in range(3)]
    for s in streams:
        sched.add(s)
    simulate_step(sched, sched.schedule())  # the short prompts prefill together; now they decode
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
        simulate_step(sched, out)
        steps += 1
    assert steps == -(-3000 // 32)


def test_without_decodes_a_prompt_gets_the_whole_budget() -> None:
    sched = _scheduler(max_num_batched_tokens=2048, max_prefill_tokens_while_decoding=32)
    long = _seq("long", 3000)
    sched.add(long)
    out = sched.schedule()
    assert _shares(out) == {"long": 2048}
    simulate_step(sched, out)
    assert _shares(sched.schedule()) == {"long": 3000 - 2048}


def test_admissions_share_the_prefill_budget() -> None:
    sched = _scheduler(max_num_batched_tokens=2048, max_prefill_tokens_while_decoding=32)
    sched.add(_seq("s", 10))
    simulate_step(sched, sched.schedule())
    for name in ("a", "b", "c"):
        sched.add(_seq(name, 20))
    out = sched.schedule()
    assert _shares(out) == {"s": 1, "a": 20, "b": 12}
    simulate_step(sched, out)
    # "b" continues its prompt before "c" starts; "a" now decodes.
    assert _shares(sched.schedule()) == {"s": 1, "a": 1, "b": 8, "c": 20}


def test_prefill_budget_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="max_prefill_tokens_while_decoding"):
        EngineConfig(max_prefill_tokens_while_decoding=0)


def _decoding(sched: Scheduler, names: list[str], prompt_len: int = 6) -> list[Sequence]:
    """Sequences admitted, prefilled and past their first sampled token."""
    seqs = [_seq(name, prompt_len) for name in names]
    for seq in seqs:
        sched.add(seq)
    simulate_step(sched, sched.schedule())
    return seqs


def test_a_draft_rides_along_when_it_fits() -> None:
    sched = _scheduler(max_num_batched_tokens=64)
    (seq,) = _decoding(sched, ["a"])
    seq.spec.draft = [11, 12, 13]
    out = sched.schedule()
    (item,) = out.scheduled
    assert (item.num_new_tokens, item.draft, item.samples) == (1, (11, 12, 13), True)
    assert out.num_tokens == 4
    assert len(seq.block_table) * 16 >= seq.num_tokens + 3  # KV slots for the draft's rows


def test_a_draft_over_the_token_budget_is_dropped_without_a_nudge() -> None:
    sched = _scheduler(max_num_batched_tokens=4)
    (seq,) = _decoding(sched, ["a"], prompt_len=3)
    seq.spec.draft = [11, 12, 13, 14]  # 1 pending + 4 > 4
    (item,) = sched.schedule().scheduled
    assert item.draft == () and item.num_new_tokens == 1
    assert seq.spec.draft == [] and seq.spec.acceptance == INITIAL_ACCEPTANCE


def test_a_draft_without_free_kv_blocks_is_dropped_instead_of_preempting() -> None:
    config = EngineConfig(block_size=4, num_kv_blocks=2, max_num_batched_tokens=64)
    sched = Scheduler(config, BlockManager(2, 4))
    seq = make_seq("a", [1, 2, 3])
    sched.add(seq)
    simulate_step(sched, sched.schedule())  # 4 tokens: block 1 is full
    seq.spec.draft = [5, 6, 7, 8, 9]  # positions 3..8 need a third block
    out = sched.schedule()
    assert out.preempted == [] and [i.draft for i in out.scheduled] == [()]
    assert seq.spec.draft == [] and len(seq.block_table) == 1


def test_a_draft_that_does_not_pay_off_in_a_big_batch_is_skipped_and_retried_later() -> None:
    sched = _scheduler(max_num_batched_tokens=256)
    seqs = _decoding(sched, [f"s{i}" for i in range(8)])
    for seq in seqs:
        seq.spec.draft = [11, 12]
        seq.spec.acceptance = 0.3  # below the break-even rate among eight (~57%)
    out = sched.schedule()
    assert [i.draft for i in out.scheduled] == [()] * 8
    for seq in seqs:
        assert seq.spec.draft == []
        assert seq.spec.acceptance == pytest.approx(0.3 + SKIP_RECOVERY)


def test_a_prefill_cut_into_chunks_drops_the_draft_set_before_it() -> None:
    sched = _scheduler(max_num_batched_tokens=8)
    seq = _seq("a", 20)
    seq.spec.draft = [11, 12]  # as the leading forced text's boundary would
    sched.add(seq)
    (item,) = sched.schedule().scheduled
    assert (item.num_new_tokens, item.draft, item.samples) == (8, (), False)
    assert seq.spec.draft == []
    whole = _scheduler(max_num_batched_tokens=64)
    short = _seq("b", 6)
    short.spec.draft = [11, 12]
    whole.add(short)
    (item,) = whole.schedule().scheduled
    assert (item.num_new_tokens, item.draft, item.samples) == (6, (11, 12), True)
