"""Speculative decoding: drafts from several sources, checked by the grammar and verified in one pass.

A draft is a guess of a request's next few tokens, from one of the sources in
:mod:`agent_infer.engine.drafts`: the grammar-forced text jump-forward leaves to the model
(certain, so always preferred), the checkpoint's MTP module chained over its own outputs, or
prompt lookup (the tokens that followed the newest n-gram's latest earlier occurrence). Which
guessed sources a request may use follows ``speculative_source`` (engine option, environment or
per request: ``auto`` = MTP and prompt lookup where the checkpoint has MTP layers, else prompt
lookup; ``mtp``; ``ngram``; ``off``); when both propose, the one with the larger expected number of
accepted tokens is fed (:func:`~agent_infer.engine.drafts.base.expected_accepted`). A draft is at
most the request's ``speculative_tokens`` long. A constrained request's draft is cut at the first
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
average that decides whether a draft pays off in a batch) lives in
:class:`~agent_infer.engine.spec_state.SpecState` on ``Sequence.spec``.

Requests asking for logprobs, penalties or ``close_on_length`` never draft: their per-token
bookkeeping assumes one sampled token per step. DRY alone is the exception: it depends only on
the tokens before a row, so the engine applies it to each draft row as if the draft tokens before
it were accepted (``penalties.apply_dry_to_draft_rows``), and verification chooses what plain
decoding would.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from agent_infer.engine.boundary_drafts import SplitMemory
from agent_infer.engine.closing import remaining_tokens
from agent_infer.engine.drafts.base import AUTO, MTP, NGRAM, OFF, Draft, expected_accepted
from agent_infer.engine.drafts.forced import forced_draft, grammar_prefix
from agent_infer.engine.drafts.mtp import MTPDrafter
from agent_infer.engine.drafts.ngram import NgramIndex
from agent_infer.engine.sampler import sample_row
from agent_infer.engine.sequence import Sequence
from agent_infer.engine.spec_state import draft_pays_off
from agent_infer.errors import InvalidRequestError
from agent_infer.model.layers.native_ops import argmax_rows
from agent_infer.sampling_params import SamplingParams


def can_draft(params: SamplingParams) -> bool:
    """Whether a request with ``params`` may use drafts (see the module docstring)."""
    return (
        params.logprobs is None and (not params.penalized or params.only_dry) and not params.close_on_length
    )


class Speculator:
    """Proposes drafts for running sequences and verifies them against the model's rows.

    ``max_tokens`` is the engine's longest guessed draft (0: no guessed drafts), ``mode`` its
    ``speculative_source`` (resolved: ``mtp`` only with ``mtp``), ``boundary`` turns the forced
    source on, and ``mtp`` drafts from the checkpoint's MTP module.
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
    ) -> None:
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.jump_forward = jump_forward
        self.boundary = boundary
        self.mtp = mtp
        self.mode = mode
        self.splits = SplitMemory()

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
        """Set each sequence's draft for the next step (empty when nothing is worth drafting or the
        request may not draft); MTP requests first pass their committed rows through the module."""
        wanted: list[tuple[Sequence, int, Draft | None]] = []
        for seq in seqs:
            spec = seq.spec
            spec.draft = []
            spec.forced_after = False
            spec.source = ""
            if not can_draft(seq.params) or seq.params.speculative_source == OFF:
                continue
            if not spec.configured:  # a sequence the engine's add_request did not make
                self.configure(seq)
            if spec.index is None:
                spec.index = NgramIndex()
                spec.draft_len = max(1, spec.max_len)
            # Room for the draft and the token sampled after it, within max_tokens and the context.
            room = remaining_tokens(seq, self.max_model_len) - 1
            if room <= 0:
                continue
            forced = forced_draft(seq, self.splits, room) if self.boundary else None
            if forced is not None:
                self._set(seq, forced)
                continue
            limit = min(spec.max_len, room)
            if limit <= 0:
                continue
            ngram: Draft | None = None
            if spec.use_ngram:
                tokens = spec.index.lookup(seq.token_ids, min(spec.draft_len, limit))
                if tokens:
                    ngram = Draft(NGRAM, tokens, [spec.ngram_acceptance] * len(tokens))
            if spec.use_mtp and draft_pays_off(spec, len(seqs)):
                wanted.append((seq, limit, ngram))
            elif spec.use_mtp and ngram is None:
                # The scheduler would drop the draft in a batch this size: skip the chained passes
                # and nudge the average as it would, so drafting is tried again later.
                spec.skip()
            elif ngram is not None:
                self._set(seq, ngram)
        if self.mtp is None:
            return
        self.mtp.catch_up([seq for seq in seqs if seq.spec.use_mtp])
        if not wanted:
            return
        drafts = self.mtp.propose([(seq, limit) for seq, limit, _ in wanted])
        for (seq, _, ngram), mtp in zip(wanted, drafts):
            best = (
                mtp
                if ngram is None or expected_accepted(mtp.probs) >= expected_accepted(ngram.probs)
                else ngram
            )
            if best.tokens:
                self._set(seq, best)

    def _set(self, seq: Sequence, draft: Draft) -> None:
        tokens = draft.tokens
        if seq.matcher is not None:
            tokens, seq.spec.forced_after = grammar_prefix(seq, tokens, self.jump_forward)
        seq.spec.draft = tokens
        seq.spec.source = draft.source if tokens else ""

    def verify(self, seq: Sequence, draft: Seq[int], rows: torch.Tensor) -> tuple[list[int], int]:
        """Tokens ``seq`` gains from masked logits ``rows`` ``[1 + len(draft), vocab]`` and how many
        of them are draft tokens: the accepted prefix of ``draft``, then one token of the model's
        own, except after a whole draft that jump-forward continues (plain decoding would append
        forced tokens there, not sample). Updates the draft-length schedules and counters."""
        bonus = not seq.spec.forced_after
        tokens, n = verify_rows(rows, draft, seq.params, seq.generator, bonus=bonus)
        seq.spec.record(len(draft), n, max(1, seq.spec.max_len))
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
