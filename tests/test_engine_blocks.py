"""BlockManager and Scheduler without a model: paging, prefix caching, chunking, preemption."""

from __future__ import annotations

import pytest

from agent_infer.engine.block_manager import BlockManager
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.scheduler import Scheduler, SchedulerOutput
from agent_infer.engine.sequence import FinishReason, Sequence, SequenceStatus
from agent_infer.errors import ConfigError
from agent_infer.sampling_params import SamplingParams


def make_seq(name: str, tokens: list[int]) -> Sequence:
    return Sequence(name, tokens, SamplingParams(temperature=0.0, max_tokens=8))


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    """Pretend the model ran over every token of ``seq``."""
    seq.num_computed_tokens = seq.num_tokens
    bm.register_computed(seq)


def test_allocate_and_free_on_deallocate() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a", list(range(10)))
    assert bm.can_allocate(seq)
    bm.allocate(seq)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert bm.num_free_blocks == 5 and bm.usage == pytest.approx(3 / 8)
    assert all(bm.blocks[b].ref_count == 1 for b in seq.block_table)
    bm.deallocate(seq)
    assert seq.block_table == [] and bm.num_free_blocks == 8 and bm.usage == 0.0


def test_cannot_allocate_beyond_pool() -> None:
    bm = BlockManager(num_blocks=2, block_size=4)
    assert not bm.can_allocate(make_seq("a", list(range(9))))
    assert bm.can_allocate(make_seq("b", list(range(8))))


def test_prefix_hit_shares_blocks_and_counts_refs() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_seq("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    bm.allocate(first)
    assert first.num_computed_tokens == 0
    compute_all(bm, first)
    second = make_seq("b", [1, 2, 3, 4, 5, 6, 7, 8, 42, 43, 44])
    bm.allocate(second)
    # Two full blocks (8 tokens) are shared; the third differs.
    assert second.num_computed_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2]
    assert [bm.blocks[b].ref_count for b in second.block_table[:2]] == [2, 2]
    bm.deallocate(first)
    assert [bm.blocks[b].ref_count for b in second.block_table[:2]] == [1, 1]


def test_uncomputed_blocks_are_not_shared() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_seq("a", list(range(12)))
    bm.allocate(first)  # allocated but the model has not run yet
    second = make_seq("b", list(range(12)))
    bm.allocate(second)
    assert second.num_computed_tokens == 0
    assert not set(first.block_table) & set(second.block_table)


def test_last_token_is_never_served_from_cache() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_seq("a", list(range(8)))
    bm.allocate(first)
    compute_all(bm, first)
    again = make_seq("b", list(range(8)))
    bm.allocate(again)
    assert again.num_computed_tokens == 4  # the block holding the last token is recomputed


def test_freed_blocks_keep_prefix_until_reused() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    first = make_seq("a", list(range(9)))
    bm.allocate(first)
    compute_all(bm, first)
    bm.deallocate(first)
    revived = make_seq("b", list(range(9)))
    bm.allocate(revived)
    assert revived.num_computed_tokens == 8
    bm.deallocate(revived)
    # A different prompt that needs the whole pool evicts the cached blocks.
    other = make_seq("c", list(range(100, 116)))
    bm.allocate(other)
    bm.deallocate(other)
    assert bm.hash_to_block == {}
    cold = make_seq("d", list(range(9)))
    bm.allocate(cold)
    assert cold.num_computed_tokens == 0


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    first = make_seq("a", list(range(12)))
    bm.allocate(first)
    compute_all(bm, first)
    second = make_seq("b", list(range(12)))
    bm.allocate(second)
    assert second.num_computed_tokens == 0


def test_append_grows_block_table_at_block_boundary() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a", list(range(4)))
    bm.allocate(seq)
    assert len(seq.block_table) == 1
    seq.append_token(99)
    assert bm.can_append(seq)
    bm.append(seq)
    assert len(seq.block_table) == 2
    seq.append_token(100)
    bm.append(seq)
    assert len(seq.block_table) == 2


def simulate_step(sched: Scheduler, out: SchedulerOutput, next_token: int = 7) -> None:
    """Advance like the engine would, appending a token to every sequence that samples."""
    sched.advance(out)
    for item in out.scheduled:
        if item.samples:
            item.seq.append_token(next_token)


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


def test_engine_config_validation() -> None:
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig(block_size=0)
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig(dtype="float64")
    with pytest.raises(ConfigError, match="max_num_sqs"):
        EngineConfig.from_kwargs(max_num_sqs=4)
