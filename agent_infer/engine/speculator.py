"""Speculative decoding: drafts from several sources, checked by the grammar and verified in one pass.

A draft is a guess of a request's next few tokens, from one of the sources in
:mod:`agent_infer.engine.drafts`: the grammar-forced text jump-forward leaves to the model
(certain, so always preferred), the checkpoint's MTP module chained over its own outputs, or
prompt lookup (the tokens that followed the newest n-gram's latest earlier occurrence). Which
guessed sources a request may use follows ``speculative_source`` (engine option, environment or
per request: ``auto`` = MTP and prompt lookup where the checkpoint has MTP layers, else prompt
lookup; ``mtp``; ``ngram``; ``off``). Each request feeds, per step, the draft with the largest
positive net gain: the tokens it is expected to keep
(:func:`~agent_infer.engine.drafts.base.expected_accepted`) less what its rows and its source's
compute cost the batch, in tokens (:mod:`agent_infer.engine.drafts.cost`, measured online). MTP is
run only for the requests whose recent MTP drafts are expected to pay, so drafting turns down in a
batch where it does not, and the planning itself backs off while it does not pay for its own time
(:mod:`~agent_infer.engine.drafts.gate`). A draft is at most the request's ``speculative_tokens`` long, and its tail
is cut where a token's chance of being kept no longer pays for its row. A constrained request's draft is cut at the first
token its grammar rejects and after any token past which the grammar fixes the text (jump-forward
appends those), so every drafted token is one the mask would allow (MTP proposals are masked by
the grammar at each position before they are chosen). Where jump-forward leaves the end of a forced text to the model, that text's
tokens are the draft instead (:mod:`agent_infer.engine.boundary_drafts`).

The next step feeds the request's pending tokens plus its draft; the model returns logits for
the last pending token and for each draft token, each masked by the grammar state at its
position. Verification keeps the longest accepted draft prefix plus one token from the first row
that disagrees (or a bonus token when all agree, unless forced tokens follow the whole draft).
Each row's token is chosen exactly as plain decoding would choose it (the arg-max, or an
inverse-CDF draw of one number from the request's generator), and a draft token is accepted when
it equals that choice. So greedy and seeded requests decode the same tokens with or without
drafts, whatever the batch (bit for bit on the native CPU path, where each row of a short chunk
attends as if decoded alone; elsewhere up to the rounding of a multi-row pass); for a sampled request
a draft token is accepted with exactly its probability under the row, as in speculative sampling
with a deterministic draft.

Per-request state (the draft, the n-gram index, the draft-length schedule and the acceptance
averages) lives in
:class:`~agent_infer.engine.spec_state.SpecState` on ``Sequence.spec``.

Requests asking for logprobs, penalties or ``close_on_length`` never draft: their per-token
bookkeeping assumes one sampled token per step. DRY alone is the exception: it depends only on
the tokens before a row, so the engine applies it to each draft row as if the draft tokens before
it were accepted (``penalties.apply_dry_to_draft_rows``), and verification chooses what plain
decoding would.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

import torch

from agent_infer.engine.boundary_drafts import SplitMemory
from agent_infer.engine.closing import remaining_tokens
from agent_infer.engine.drafts.base import AUTO, MTP, NGRAM, OFF, Draft
from agent_infer.engine.drafts.forced import forced_draft, grammar_prefix
from agent_infer.engine.drafts.gate import PlanGate
from agent_infer.engine.drafts.mtp import MTPDrafter
from agent_infer.engine.drafts.ngram import NgramIndex
from agent_infer.engine.drafts.policy import Candidate, DraftPolicy
from agent_infer.engine.sampler import sample_row
from agent_infer.engine.scheduler import ScheduledSequence
from agent_infer.engine.sequence import Sequence
from agent_infer.engine.spec_state import draft_pays_off
from agent_infer.errors import InvalidRequestError
from agent_infer.model.layers.native_ops import argmax_rows
from agent_infer.sampling_params import SamplingParams

#: Longest pending chunk of a step the cost model counts as decoding (forced runs, not prompts).
MAX_DECODE_CHUNK = 16


def can_draft(params: SamplingParams) -> bool:
    """Whether a request with ``params`` may use drafts (see the module docstring)."""
    return (
        params.logprobs is None and (not params.penalized or params.only_dry) and not params.close_on_length
    )


class Speculator:
    """Proposes drafts for running sequences and verifies them against the model's rows.

    ``max_tokens`` is the engine's longest guessed draft (0: no guessed drafts), ``mode`` its
    ``speculative_source`` (resolved: ``mtp`` only with ``mtp``), ``boundary`` turns the forced
    source on, ``mtp`` drafts from the checkpoint's MTP modules, and ``row_multiple`` is what the
    model pads a step's rows to (the cost of a draft's rows, :mod:`~agent_infer.engine.drafts.cost`).
    """

    def __init__(
        self,
        max_tokens: int,
        max_model_len: int,
        jump_forward: bool = True,
        boundary: bool = False,
        *,
        mtp: MTPDrafter | None = None,
        mode: str = AUTO,
        row_multiple: int = 1,
    ) -> None:
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.jump_forward = jump_forward
        self.boundary = boundary
        self.mtp = mtp
        self.mode = mode
        self.splits = SplitMemory()
        self.policy = DraftPolicy(row_multiple)
        self.gate = PlanGate()
        #: Seconds of MTP catch-up upkeep in the current proposal round (not charged to its plan).
        self.upkeep_seconds = 0.0
        if mtp is not None:
            mtp.on_pass = lambda rows, seconds: self.policy.cost.observe_pass(MTP, rows, seconds)

    def configure(self, seq: Sequence) -> None:
        """Set which guessed sources ``seq`` may use and its longest draft, from its params and the
        engine's settings. A request asking for ``mtp`` on a model without MTP drafts raises
        :class:`InvalidRequestError`; a request cannot turn on drafts the engine has off."""
        params, spec = seq.params, seq.spec
        mode = params.speculative_source or self.mode
        if params.speculative_source == MTP and self.mtp is None:
            raise InvalidRequestError(
                "speculative_source='mtp' needs MTP drafts: the model has no MTP layers or the engine "
                "runs with speculative_source='off', 'ngram' or speculative_tokens=0",
                field="speculative_source",
            )
        spec.mode = mode
        spec.configured = True
        on = self.max_tokens > 0 and mode != OFF
        spec.use_mtp = on and self.mtp is not None and mode in (AUTO, MTP)
        spec.use_ngram = on and (mode in (NGRAM, AUTO))
        if params.speculative_tokens is not None:
            spec.max_len = min(params.speculative_tokens, self.max_tokens)
        else:
            spec.max_len = self.max_tokens
        if mode == OFF:
            spec.max_len = 0

    def propose(self, seq: Sequence) -> None:
        """Set ``seq.spec.draft`` for the next step (see :meth:`propose_all`)."""
        self.propose_all([seq])

    def propose_all(self, seqs: list[Sequence]) -> None:
        """Set each sequence's draft for the next step (empty when none is worth feeding or the
        request may not draft). Under ``auto`` the source and length with the largest positive net
        gain (:mod:`~agent_infer.engine.drafts.policy`), on the steps the plan gate opens
        (:mod:`~agent_infer.engine.drafts.gate`); under ``mtp`` or ``ngram`` that source's draft,
        fed while the request's acceptance beats the batch's break-even rate
        (``spec_state.draft_pays_off``)."""
        started = time.perf_counter()
        self.upkeep_seconds = 0.0
        batch = len(seqs)
        rows = batch
        plan = self.gate.open(batch)
        weighed: list[Candidate] = []
        explicit: list[Candidate] = []
        for seq in seqs:
            candidate = self._candidate(seq, batch, rows, plan)
            if candidate is None:
                rows += len(seq.spec.draft)
                continue
            spec = seq.spec
            if spec.mode == AUTO:
                weighed.append(candidate)
            elif spec.use_mtp and draft_pays_off(spec, batch):
                explicit.append(candidate)
            elif spec.use_mtp:
                # The scheduler would drop the draft in a batch this size: skip the chained passes
                # and nudge the average as it would, so drafting is tried again later.
                spec.skip()
            elif candidate.lookup is not None:
                self._set(seq, candidate.lookup, weigh=False)
        if weighed:
            self.policy.plan(weighed, batch, rows, mtp=self.mtp is not None, idle=self.gate.take_idle())
        drafting = [c for c in weighed if c.mtp_limit] + explicit
        for c in weighed:
            if not c.mtp_limit:
                self._settle(c, batch)
        self._mtp_round(seqs, drafting, batch)
        if weighed:
            self._close_plan(weighed, batch, rows, time.perf_counter() - started)

    def _mtp_round(self, seqs: list[Sequence], drafting: list[Candidate], batch: int) -> None:
        """Catch up the requests whose MTP queues grew long, and run MTP for ``drafting``."""
        if self.mtp is None:
            return
        busy = {id(c.seq) for c in drafting}
        lagging = [s for s in seqs if s.spec.use_mtp and id(s) not in busy and self.mtp.needs_catch_up(s)]
        if lagging:
            # Upkeep that bounds the queues' memory, not a cost of this step's plan.
            started = time.perf_counter()
            self.mtp.catch_up(lagging)
            self.upkeep_seconds += time.perf_counter() - started
        if not drafting:
            return
        limits = [(c.seq, c.mtp_limit or c.limit) for c in drafting]
        for c, draft in zip(drafting, self.mtp.propose(limits)):
            c.mtp = draft
            if c.seq.spec.mode != AUTO:
                if draft.tokens:
                    self._set(c.seq, draft, weigh=False)
                continue
            if not draft.tokens:
                # A round that proposed nothing kept nothing: the record that chose it learns so.
                self.policy.record(c.seq, MTP, 1, 0)
            self._settle(c, batch)

    def _close_plan(self, weighed: list[Candidate], batch: int, rows: int, seconds: float) -> None:
        """Tell the plan gate what this step's plan is worth against what it cost, in tokens: the
        kept tokens expected of the guessed drafts it fed less their rows, against the planning
        and MTP time (``seconds``, less the catch-up upkeep) at the step's rate."""
        seconds -= self.upkeep_seconds
        cost = self.policy.cost
        base = cost.step_time(rows)
        if base is None or base <= 0.0:
            return
        kept = 0.0
        added = fed = 0
        for c in weighed:
            spec = c.seq.spec
            if spec.draft and spec.source in (MTP, NGRAM):
                kept += sum(self.policy.curve(c.seq, spec.source, len(spec.draft)))
                added += len(spec.draft)
                fed += 1
        rate = batch / base
        grown = cost.step_time(rows + added, fed) or base
        self.gate.settle(kept - rate * (grown - base), rate * max(seconds, 0.0))

    def _candidate(self, seq: Sequence, batch: int, rows: int, plan: bool = True) -> Candidate | None:
        """Reset ``seq``'s draft and gather what it may draft: None when it may not draft, took the
        grammar-forced draft, or is an ``auto`` request on a step without a plan (``plan`` False);
        else its room and its prompt-lookup draft (MTP runs later, batched)."""
        spec = seq.spec
        spec.draft = []
        spec.forced_after = False
        spec.source = ""
        spec.weighed = False
        if not plan and spec.configured and spec.mode == AUTO and seq.matcher is None:
            return None  # no plan this step, and without a grammar no forced draft either
        if not can_draft(seq.params) or seq.params.speculative_source == OFF:
            return None
        if not spec.configured:  # a sequence the engine's add_request did not make
            self.configure(seq)
        if spec.index is None:
            spec.index = NgramIndex()
            spec.draft_len = max(1, spec.max_len)
        # Room for the draft and the token sampled after it, within max_tokens and the context.
        room = remaining_tokens(seq, self.max_model_len) - 1
        if room <= 0:
            return None
        forced = forced_draft(seq, self.splits, room) if self.boundary else None
        if forced is not None:
            auto = spec.mode == AUTO
            self._set(seq, self.policy.forced(forced, batch, rows) if auto else forced, weigh=auto)
            return None
        if not plan and spec.mode == AUTO:
            return None
        limit = min(spec.max_len, room)
        if limit <= 0:
            return None
        candidate = Candidate(seq, limit)
        if spec.use_ngram:
            # Under auto the policy picks the length; otherwise the acceptance schedule does.
            length = limit if spec.mode == AUTO else min(spec.draft_len, limit)
            tokens = spec.index.lookup(seq.token_ids, length)
            if tokens:
                candidate.lookup = Draft(NGRAM, tokens, [spec.ngram_acceptance] * len(tokens))
        return candidate

    def _settle(self, c: Candidate, batch: int) -> None:
        draft = self.policy.settle(c, batch)
        if draft is not None:
            self._set(c.seq, draft, weigh=True)

    def _set(self, seq: Sequence, draft: Draft, weigh: bool) -> None:
        """Make ``draft`` (cut to what the grammar accepts) ``seq``'s pending draft; ``weigh``: the
        policy weighed it (the scheduler then passes it)."""
        tokens = draft.tokens
        if seq.matcher is not None:
            tokens, seq.spec.forced_after = grammar_prefix(seq, tokens, self.jump_forward)
        seq.spec.draft = tokens
        seq.spec.source = draft.source if tokens else ""
        seq.spec.weighed = weigh and bool(tokens)

    def observe_step(self, batch: Seq[ScheduledSequence], seconds: float) -> None:
        """Account for a step that ran ``batch`` in ``seconds`` (decode steps only: a prefill chunk
        costs another regime than the rows a draft adds)."""
        rows = drafting = 0
        for item in batch:
            if not item.samples or item.num_new_tokens > MAX_DECODE_CHUNK:
                return
            rows += item.num_fed_tokens
            drafting += bool(item.draft)
        self.policy.cost.observe_step(rows, seconds, drafting)

    def verify(self, seq: Sequence, draft: Seq[int], rows: torch.Tensor) -> tuple[list[int], int]:
        """Tokens ``seq`` gains from masked logits ``rows`` ``[1 + len(draft), vocab]`` and how many
        of them are draft tokens: the accepted prefix of ``draft``, then one token of the model's
        own, except after a whole draft that jump-forward continues (plain decoding would append
        forced tokens there, not sample). Updates the draft-length schedules and counters."""
        bonus = not seq.spec.forced_after
        tokens, n = verify_rows(rows, draft, seq.params, seq.generator, bonus=bonus)
        seq.spec.record(len(draft), n, max(1, seq.spec.max_len))
        if draft:
            self.policy.record(seq, seq.spec.source, len(draft), n)
        return tokens, n


def verify_rows(
    rows: torch.Tensor,
    draft: Seq[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    bonus: bool = True,
) -> tuple[list[int], int]:
    """Choose each row's token as plain decoding would (arg-max, or one draw from ``generator``),
    stopping at the first that differs from the draft's; after a whole draft, choose the next row's
    only when ``bonus``. Returns the tokens and how many of them are accepted draft tokens."""
    best: list[int] = argmax_rows(rows) if params.greedy else []
    tokens: list[int] = []
    accepted = 0
    for j in range(len(draft) + 1):
        if j == len(draft) and not bonus:
            break
        token = best[j] if params.greedy else sample_row(rows[j], params, generator)
        tokens.append(token)
        if j == len(draft) or token != draft[j]:
            break
        accepted += 1
    return tokens, accepted
