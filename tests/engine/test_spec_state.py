"""SpecState, the per-request speculation state: n-gram index, draft-length schedule, acceptance average."""

from __future__ import annotations

import pytest
import torch

from agent_infer import SamplingParams
from agent_infer.engine.drafts.mtp import MAX_QUEUED, MAX_QUEUED_BYTES, MIN_QUEUED, queue_bound
from agent_infer.engine.drafts.ngram import NgramIndex
from agent_infer.engine.sequence import Sequence
from agent_infer.engine.spec_state import (
    ACCEPTANCE_EMA,
    INITIAL_ACCEPTANCE,
    SKIP_RECOVERY,
    MTPQueue,
    SpecState,
    draft_pays_off,
)


def test_every_sequence_starts_with_an_empty_state() -> None:
    spec = Sequence("r", [1, 2, 3], SamplingParams()).spec
    assert spec == SpecState()
    assert spec.draft == [] and spec.index is None and not spec.forced_after
    assert (spec.num_drafted, spec.num_accepted, spec.acceptance) == (0, 0, INITIAL_ACCEPTANCE)
    assert Sequence("s", [1], SamplingParams()).spec.draft is not spec.draft  # not shared


def test_drafts_pay_off_only_above_the_break_even_rate_for_the_batch() -> None:
    spec = SpecState(acceptance=0.3)
    assert draft_pays_off(spec, 1)  # alone: break-even ~14%
    assert not draft_pays_off(spec, 8)  # among eight: ~57%
    assert spec.acceptance == 0.3  # deciding changes nothing


def test_a_skipped_draft_is_dropped_and_retried_later() -> None:
    spec = SpecState(draft=[4, 5], acceptance=0.3)
    spec.skip()
    assert spec.draft == [] and spec.acceptance == pytest.approx(0.3 + SKIP_RECOVERY)
    skips = 0
    while not draft_pays_off(spec, 8):
        spec.skip()
        skips += 1
    assert 0 < skips < 10  # back above the break-even rate after a few skipped steps
    spec.acceptance = 0.99
    spec.skip()
    assert spec.acceptance == 1.0


def test_record_grows_the_draft_after_full_acceptance_and_shrinks_it_after_a_rejection() -> None:
    spec = SpecState(draft_len=3)
    spec.record(drafted=3, accepted=3, max_len=5)
    assert spec.draft_len == 4
    assert spec.acceptance == pytest.approx(INITIAL_ACCEPTANCE + ACCEPTANCE_EMA * (1 - INITIAL_ACCEPTANCE))
    spec.record(drafted=4, accepted=4, max_len=5)
    spec.record(drafted=5, accepted=5, max_len=5)
    assert spec.draft_len == 5  # capped at the configured length
    before = spec.acceptance
    spec.record(drafted=5, accepted=1, max_len=5)
    assert spec.draft_len == 2  # one more than the accepted prefix
    assert spec.acceptance == pytest.approx(before + ACCEPTANCE_EMA * (0.2 - before))
    spec.record(drafted=2, accepted=0, max_len=5)
    assert spec.draft_len == 1
    assert (spec.num_drafted, spec.num_accepted) == (3 + 4 + 5 + 5 + 2, 3 + 4 + 5 + 1 + 0)


def test_record_of_an_empty_draft_changes_no_schedule() -> None:
    spec = SpecState(draft_len=3)
    spec.record(drafted=0, accepted=0, max_len=5)
    assert spec == SpecState(draft_len=3)


def test_ngram_index_prefers_longest_latest_match() -> None:
    index = NgramIndex()
    tokens = [1, 2, 3, 9, 1, 2, 4, 7, 2]
    # Suffix [2]: latest earlier occurrence is at 5 -> followed by 4, 7, 2.
    assert index.lookup(tokens, 3) == [4, 7, 2]
    tokens += [3]  # suffix [2, 3] occurs at 1..2 -> followed by 9, 1
    assert index.lookup(tokens, 2) == [9, 1]
    assert NgramIndex().lookup([5, 6, 7], 4) == []  # nothing repeats
    assert NgramIndex().lookup([5], 4) == []


def test_an_mtp_queue_joins_its_rows_only_when_read() -> None:
    q = MTPQueue()
    q.add(10, torch.zeros(3, 4))
    q.add(13, torch.ones(2, 4))  # continues the queue: kept as a part, not copied
    assert q.queued == 5 and len(q.parts) == 2
    taken = q.take(4)
    assert taken.tolist() == [[0.0] * 4] * 3 + [[1.0] * 4]
    assert (q.first, q.queued) == (14, 1) and q.rows is not None and q.rows.tolist() == [[1.0] * 4]
    q.add(3, torch.full((2, 4), 2.0))  # a recompute after preemption: replaces the queue
    assert (q.first, q.queued) == (3, 2)
    q.take(2)
    assert q.rows is None and q.queued == 0


def test_an_mtp_queue_is_bounded_by_memory() -> None:
    small, wide, huge = MTPQueue(), MTPQueue(), MTPQueue()
    small.add(0, torch.zeros(1, 64))  # the tiny checkpoint's hidden rows: the row cap binds
    wide.add(0, torch.zeros(1, 7168))  # DeepSeek V3's: the memory bound does
    huge.add(0, torch.zeros(1, 1 << 16))
    assert queue_bound(small) == MAX_QUEUED
    assert queue_bound(wide) == MAX_QUEUED_BYTES // (7168 * 4)
    assert queue_bound(huge) == MIN_QUEUED
