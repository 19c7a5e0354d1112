"""The ``auto`` draft policy's parts: the online step and pass costs, survival records, the best
draft length (padded rows), and the choice between prompt lookup, MTP and no draft."""

from __future__ import annotations

import random

import pytest

from agent_infer import SamplingParams
from agent_infer.engine.drafts.base import MTP, NGRAM, Draft
from agent_infer.engine.drafts.cost import CostModel
from agent_infer.engine.drafts.policy import Candidate, DraftPolicy
from agent_infer.engine.drafts.survival import Survival
from agent_infer.engine.sequence import Sequence

A, B = 0.010, 0.002  # a step of R rows: A + B * pad4(R) seconds


def _measured(model: CostModel, rows: range = range(1, 13)) -> CostModel:
    rng = random.Random(0)
    for _ in range(200):
        r = rng.choice(list(rows))
        model.observe_step(r, A + B * model.pad(r))
    return model


def test_the_step_line_is_fitted_on_padded_rows() -> None:
    model = _measured(CostModel(row_multiple=4))
    line = model.step_line()
    assert line is not None
    assert line[0] == pytest.approx(A, rel=1e-6) and line[1] == pytest.approx(B, rel=1e-6)
    assert model.step_time(2) == pytest.approx(A + 4 * B) and model.step_time(5) == pytest.approx(A + 8 * B)


def test_without_spread_in_rows_the_prior_splits_the_step() -> None:
    model = CostModel()
    assert model.step_line() is None and model.step_time(3) is None
    for _ in range(5):
        model.observe_step(4, 0.02)
    a, b = model.step_line() or (0.0, 0.0)
    assert a + 4 * b == pytest.approx(0.02) and a == pytest.approx(6.0 * b)


def test_pass_costs_are_shared_by_the_requests_of_a_pass() -> None:
    model = CostModel()
    assert model.pass_cost(MTP, 1) == 0.0
    for k in (1, 2, 4, 8, 1, 4):
        model.observe_pass(MTP, k, 0.004 + 0.0005 * k)
    assert model.pass_cost(MTP, 1) == pytest.approx(0.0045, rel=1e-6)
    assert model.pass_cost(MTP, 8) == pytest.approx(0.004 / 8 + 0.0005, rel=1e-6)


def test_best_length_fills_the_padded_chunk_and_pays_for_more_only_when_worth_it() -> None:
    model = _measured(CostModel(row_multiple=4))
    survival = [0.9, 0.72, 0.36, 0.14, 0.05]
    n, gain = model.best_length(survival, batch=1, rows=1)
    assert n == 3 and gain == pytest.approx(0.9 + 0.72 + 0.36)  # rows 2-4 of the chunk are free
    n, _ = model.best_length([1.0] * 5, batch=1, rows=1)
    assert n == 5  # certain tokens pay for the next chunk
    n, gain = model.best_length(survival, batch=1, rows=1, per_token=0.015)
    assert n == 1 and gain == pytest.approx(0.9 - 0.015 / (A + 4 * B))  # expensive passes: one token
    assert model.best_length(survival, batch=16, rows=16) == (0, 0.0)  # 16 requests: drafts do not pay


def test_before_any_measurement_a_draft_is_worth_what_it_keeps() -> None:
    assert CostModel().best_length([0.5, 0.25], batch=8, rows=8) == (2, 0.75)


def test_survival_counts_trials_up_to_the_first_rejection() -> None:
    s = Survival()
    for drafted, accepted in ((3, 3), (3, 1), (2, 0)):
        s.record(drafted, accepted)
    chances = s.chances(3)
    assert chances[0] == pytest.approx((0.9 * 0.9 + 0.9 + 0 + 0.5) / (0.81 + 0.9 + 1 + 1))
    assert s.curve(3) == pytest.approx(
        [chances[0], chances[0] * chances[1], chances[0] * chances[1] * chances[2]]
    )
    assert Survival().chances(2) == [0.5, 0.5]
    own = Survival()
    own.record(1, 1)
    prior = Survival()
    assert own.chances(1, prior)[0] == pytest.approx((1 + 2 * 0.5) / (1 + 2))


def _candidate(mtp: bool = True, lookup: int = 0, limit: int = 5) -> Candidate:
    seq = Sequence("r", [1, 2, 3], SamplingParams())
    seq.spec.use_mtp = mtp
    c = Candidate(seq, limit)
    if lookup:
        c.lookup = Draft(NGRAM, list(range(10, 10 + lookup)), [0.5] * lookup)
    return c


def _policy(mtp_rate: float, ngram_rate: float, pass_seconds: float) -> DraftPolicy:
    policy = DraftPolicy(row_multiple=4)
    _measured(policy.cost)
    policy.survival[MTP] = Survival([1.0] * 5, [mtp_rate] * 5)
    policy.survival[NGRAM] = Survival([1.0] * 5, [ngram_rate] * 5)
    for k in (1, 2, 3):
        policy.cost.observe_pass(MTP, k, pass_seconds)
    return policy


def test_alone_a_good_cheap_mtp_drafts_up_to_the_padded_chunk() -> None:
    policy = _policy(mtp_rate=0.9, ngram_rate=0.3, pass_seconds=0.0005)
    c = _candidate(lookup=4)
    policy.plan([c], batch=1, rows=1, mtp=True)
    assert c.mtp_limit == 3
    c.mtp = Draft(MTP, [7, 8], [0.6, 0.5])  # the confidence schedule stopped it at two
    assert policy.settle(c, batch=1) == Draft(MTP, [7, 8], [0.6, 0.5])


def test_expensive_mtp_passes_leave_the_request_to_prompt_lookup() -> None:
    policy = _policy(mtp_rate=0.9, ngram_rate=0.8, pass_seconds=0.05)
    c = _candidate(lookup=4)
    policy.plan([c], batch=1, rows=1, mtp=True)
    assert c.mtp_limit == 0 and c.ngram is not None and len(c.ngram) == 3
    assert policy.settle(c, batch=1) == c.ngram


def test_in_a_big_batch_drafting_turns_down() -> None:
    policy = _policy(mtp_rate=0.8, ngram_rate=0.6, pass_seconds=0.0005)
    batch = [_candidate(lookup=3) for _ in range(16)]
    policy.plan(batch, batch=16, rows=16, mtp=True)
    assert all(c.mtp_limit == 0 and c.ngram is None for c in batch)
    assert all(policy.settle(c, batch=16) is None for c in batch)


def test_a_forced_draft_is_cut_where_its_rows_stop_paying() -> None:
    policy = _policy(mtp_rate=0.5, ngram_rate=0.5, pass_seconds=0.001)
    forced = Draft("forced", [1, 2, 3, 4, 5, 6], [1.0] * 6)
    assert policy.forced(forced, batch=1, rows=1) == forced
    # Among 16, a chunk of 4 rows costs the batch about 3 tokens: 4 certain tokens pay for it, 2 do not.
    assert policy.forced(forced, batch=16, rows=16).tokens == [1, 2, 3, 4]
    assert policy.forced(Draft("forced", [1, 2], [1.0, 1.0]), batch=16, rows=16).tokens == []


def test_in_a_big_batch_sure_lookup_tokens_fill_a_chunk_together() -> None:
    """Among 16, no request's tokens pay a 4-row chunk alone, but the batch's surest tokens do."""
    policy = _policy(mtp_rate=0.5, ngram_rate=0.5, pass_seconds=0.001)
    batch = [_candidate(mtp=False, lookup=2) for _ in range(16)]
    for c in batch[:4]:
        for _ in range(30):
            policy.record(c.seq, NGRAM, 2, 2)
    policy.survival[NGRAM] = Survival([1.0] * 5, [0.5] * 5)  # the other requests: even odds
    policy.plan(batch, batch=16, rows=16, mtp=False)
    assert [len(c.ngram) if c.ngram else 0 for c in batch] == [2] * 4 + [0] * 12
    assert all(c.ngram_gain > 1.5 for c in batch[:4])


def test_an_mtp_round_pays_for_one_pass_more_than_its_tokens() -> None:
    """A round also catches the module up on the rows the last step committed, so MTP is chosen only
    when its tokens pay for that pass too."""
    step = A + 4 * B  # one row, padded to a chunk of 4
    policy = _policy(mtp_rate=0.9, ngram_rate=0.3, pass_seconds=0.5 * step)
    c = _candidate()
    per_pass = policy.cost.pass_cost(MTP, 1)
    assert per_pass == pytest.approx(0.5 * step)
    curve = policy.curve(c.seq, MTP, c.limit)
    assert policy.cost.best_length(curve, batch=1, rows=1, per_token=per_pass)[0] > 0  # tokens alone pay
    policy.plan([c], batch=1, rows=1, mtp=True)
    assert c.mtp_limit == 0
    cheap = _policy(mtp_rate=0.9, ngram_rate=0.3, pass_seconds=0.1 * step)
    c = _candidate()
    cheap.plan([c], batch=1, rows=1, mtp=True)
    assert c.mtp_limit > 0


def test_what_a_request_pays_for_drafting_at_all_is_fitted_and_charged() -> None:
    """Steps cost A + B * pad(R) + D per request carrying a draft: the fit recovers D, and a draft
    whose rows alone would pay is not fed when D outweighs it."""
    per_draft = 0.004
    model = CostModel(row_multiple=4)
    rng = random.Random(1)
    for _ in range(300):
        batch = rng.choice([1, 4, 8, 16])
        drafting = rng.randint(0, batch)
        rows = batch + sum(rng.randint(1, 3) for _ in range(drafting))
        model.observe_step(rows, A + B * model.pad(rows) + per_draft * drafting, drafting)
    assert model.per_draft() == pytest.approx(per_draft, rel=1e-6)
    assert model.step_time(5, drafting=1) == pytest.approx(A + 8 * B + per_draft)
    survival = [0.9, 0.72, 0.36]
    n, gain = model.best_length(survival, batch=1, rows=1)
    assert n == 3 and gain == pytest.approx(0.9 + 0.72 + 0.36 - per_draft / (A + 4 * B))
    assert model.best_length(survival, batch=8, rows=8) == (0, 0.0)  # rows and switch cost 8x
    plain = _measured(CostModel(row_multiple=4))
    assert plain.per_draft() == 0.0  # never saw a draft: nothing to fit


def test_a_lookup_draft_whose_first_token_does_not_pay_for_the_switch_is_passed_over() -> None:
    policy = _policy(mtp_rate=0.5, ngram_rate=0.5, pass_seconds=0.001)
    for k in range(200):  # the same steps, now with requests that pay a third of a step to draft
        drafting = k % 3
        policy.cost.observe_step(4 + drafting, A + 4 * B + 0.006 * drafting, drafting)
    assert policy.cost.per_draft() > 0.005
    batch = [_candidate(mtp=False, lookup=2) for _ in range(2)]
    policy.plan(batch, batch=2, rows=2, mtp=False)  # two free rows, but each draft costs ~0.6 tokens
    assert all(c.ngram is None for c in batch)


def test_what_drafting_costs_is_kept_while_no_request_drafts() -> None:
    """Once ``d`` turned drafting off, the steps carry no drafts to fit it on: it is kept, not
    forgotten (which would turn drafting back on until it is fitted again)."""
    model = CostModel(row_multiple=4)
    rng = random.Random(2)
    for _ in range(200):
        drafting = rng.randint(0, 8)
        rows = 8 + drafting + rng.randint(0, 8)
        model.observe_step(rows, A + B * model.pad(rows) + 0.004 * drafting, drafting)
    assert model.per_draft() == pytest.approx(0.004, rel=1e-6)
    for _ in range(200):
        rows = rng.choice([8, 12, 16])
        model.observe_step(rows, A + B * model.pad(rows), 0)
    assert model.per_draft() == pytest.approx(0.004, rel=1e-6)
    assert model.step_line() == pytest.approx((A, B), rel=1e-3)
