"""BlockManager without a model: paging, prefix caching, reference counts."""

from __future__ import annotations

import pytest

from agent_infer.engine.block_manager import BlockManager
from agent_infer.engine.sequence import Sequence
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
