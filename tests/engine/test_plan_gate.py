"""The ``auto`` plan gate: planning drafts must pay for itself, per step, against scripted step costs.

The speculator runs on real sequences and real prompt lookups; only the step costs are scripted
(fed to the policy's cost model as measured steps), so the tests fix when drafts pay.
"""

from __future__ import annotations

import pytest

from agent_infer import SamplingParams
from agent_infer.engine.drafts.gate import MAX_BACKOFF, PlanGate
from agent_infer.engine.sequence import Sequence
from agent_infer.engine.speculator import Speculator


def _closed(gate: PlanGate) -> PlanGate:
    """``gate`` after plans that were worth nothing until their average fell below their cost."""
    while gate.worth > gate.cost:
        gate.settle(worth=0.0, cost=0.5)
    return gate


def test_the_back_off_doubles_up_to_its_cap_and_ends_when_plans_pay() -> None:
    gate = PlanGate()
    for _ in range(3):
        assert gate.open(16)
        gate.settle(worth=0.0, cost=0.5)  # presumed worth: one plan worth nothing does not close it
    _closed(gate)
    sat_out = []
    for _ in range(8):
        waited = 0
        while not gate.open(16):
            waited += 1
        sat_out.append(waited)
        gate.settle(worth=0.2, cost=0.5)  # the plan of the step the gate opened did not pay
    assert sat_out == [1, 2, 4, 8, 16, MAX_BACKOFF, MAX_BACKOFF, MAX_BACKOFF]
    while not gate.open(16):
        pass
    gate.settle(worth=4.0, cost=0.5)  # one good plan lifts the average above the cost
    assert gate.open(16) and gate.open(16)  # plan every step again


def test_a_batch_of_another_size_ends_the_back_off() -> None:
    gate = _closed(PlanGate())
    gate.batch = 16
    assert not gate.open(16) and gate.take_idle() == 1
    assert gate.open(15)  # one request finished: drafts may pay now
    gate.settle(worth=0.0, cost=0.5)  # and this plan did not pay either
    assert not gate.open(15)
    assert gate.open(16)  # one joined: it may draft


def test_plans_exactly_at_their_cost_do_not_pay() -> None:
    gate = PlanGate(batch=4, worth=0.3, cost=0.3)
    gate.settle(worth=0.3, cost=0.3)
    assert not gate.open(4)


# A step of R rows costs FIXED + PER_ROW * R seconds (row multiple 1).
PER_ROW = 0.01


def _speculator(fixed: float) -> Speculator:
    spec = Speculator(max_tokens=4, max_model_len=4096, mode="auto")
    for rows in (1, 2, 4, 8, 16, 24, 32) * 8:
        spec.policy.cost.observe_step(rows, fixed + PER_ROW * rows)
    return spec


def _repetitive(n: int) -> list[Sequence]:
    """Requests whose text repeats, so prompt lookup always finds a continuation."""
    seqs = []
    for i in range(n):
        seq = Sequence(f"r{i}", [7, 8, 9, 10 + i] * 12, SamplingParams(temperature=0.0, max_tokens=500))
        seqs.append(seq)
    return seqs


def _accept_all(spec: Speculator, seqs: list[Sequence]) -> None:
    """Verify every draft as fully kept (the records learn that this text's drafts survive)."""
    for seq in seqs:
        draft = seq.spec.draft
        if draft:
            spec.policy.record(seq, seq.spec.source, len(draft), len(draft))
        seq.token_ids.extend(draft or seq.token_ids[-4:-3])


def test_alone_a_sure_draft_is_planned_every_step() -> None:
    spec = _speculator(fixed=0.05)  # the fixed cost dominates: one more row is cheap
    (seq,) = seqs = _repetitive(1)
    for _ in range(20):
        spec.propose_all(seqs)
        assert seq.spec.draft and seq.spec.source == "ngram"
        _accept_all(spec, seqs)
    assert spec.gate.wait == 0


def test_when_rows_cost_what_they_make_the_batch_stops_planning_and_probes_rarely() -> None:
    """Sixteen requests on a step that is nearly all per-row cost: no draft pays, so the gate
    closes and the prompt lookups stop; it opens again now and then to probe."""
    spec = _speculator(fixed=0.0005)
    seqs = _repetitive(16)
    planned = 0
    for _ in range(3 * MAX_BACKOFF):
        indexed = seqs[0].spec.index.indexed if seqs[0].spec.index is not None else -1
        spec.propose_all(seqs)
        assert all(not s.spec.draft for s in seqs)
        after = seqs[0].spec.index.indexed if seqs[0].spec.index is not None else -1
        planned += after != indexed  # a plan looked the request's text up (the index grew)
        for s in seqs:
            s.token_ids.append(s.token_ids[-4])
    assert 3 <= planned <= 24
    # Half the requests finished: the gate opens at once (the next plan looks the text up).
    half = seqs[:8]
    spec.propose_all(seqs)
    before = half[0].spec.index.indexed if half[0].spec.index is not None else -1
    for s in half:
        s.token_ids.append(s.token_ids[-4])
    spec.propose_all(half)
    assert half[0].spec.index is not None and half[0].spec.index.indexed > before


@pytest.mark.parametrize("fixed", [0.05, 0.0005])
def test_forced_and_explicit_drafts_do_not_wait_for_the_gate(fixed: float) -> None:
    spec = _speculator(fixed)
    seqs = _repetitive(16)
    for s in seqs:
        s.params = SamplingParams(temperature=0.0, max_tokens=500, speculative_source="ngram")
        spec.configure(s)
    spec.gate.batch = 16
    _closed(spec.gate)
    spec.propose_all(seqs)
    assert all(s.spec.draft for s in seqs)  # ngram requests are the scheduler's to weigh
