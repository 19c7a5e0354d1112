"""What speculative decoding keeps per request (``Sequence.spec``): its draft, n-gram index and confidence.

A prompt-lookup draft's length follows an acceptance schedule per request: it starts at the
request's maximum draft length, grows by one after a fully accepted draft and shrinks to one more
than the accepted prefix after a rejection; an MTP draft's length follows the confidence schedule
(:mod:`agent_infer.engine.drafts.schedule`). Whether a draft is fed at all is weighed against its
cost when it is proposed (:mod:`agent_infer.engine.drafts.cost`); the scheduler passes such drafts.
A draft set without that weighing (``weighed`` False) is fed only when the request's acceptance
average beats the break-even rate of a step of ``B`` rows costing ``a + b·B``: ``B / (B + a/b)``
(``a/b`` = :data:`STEP_COST_IN_ROWS`; 14% alone, 57% among eight); below it the scheduler drops the
draft and nudges the average up (:meth:`SpecState.skip`), so the request tries again later.

MTP state (:class:`MTPQueue`, one per MTP module): module ``d`` at position ``i`` reads an input
state (the main model's hidden state for ``d = 0``, module ``d - 1``'s output at ``i`` after) and
the token at ``i + d + 1``. Committed rows wait in the module's queue until that token is known;
each module's newest committed output is kept for the next draft's chain.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agent_infer.engine.drafts.base import AUTO
from agent_infer.engine.drafts.ngram import NgramIndex
from agent_infer.engine.drafts.schedule import ConfidenceSchedule
from agent_infer.engine.drafts.survival import Survival

#: Fixed cost of a forward step over the cost of one more row (``a/b`` in the module docstring), for
#: drafts not weighed when proposed. Measured on CPU; on accelerators extra rows are relatively
#: cheaper, so this is conservative.
STEP_COST_IN_ROWS = 6.0
#: Weight of the newest draft in a request's acceptance average, and the average's start value.
ACCEPTANCE_EMA = 0.3
INITIAL_ACCEPTANCE = 0.6
#: How far a skipped draft moves the average back up (retry after a few skipped steps).
SKIP_RECOVERY = 0.05


@dataclass(slots=True)
class MTPQueue:
    """One MTP module's state for a request: input rows of committed positions ``first, first + 1,
    ...`` not yet run (:attr:`rows`), and the module's output at its newest run position ``newest``.

    Rows arrive a step at a time and are joined only when read, so a request that does not draft
    pays no copy per step."""

    first: int = 0
    parts: list[torch.Tensor] = field(default_factory=list)
    queued: int = 0
    newest: int = -1
    output: torch.Tensor | None = None

    @property
    def rows(self) -> torch.Tensor | None:
        """The queued rows, joined (None when none are queued)."""
        if not self.parts:
            return None
        if len(self.parts) > 1:
            self.parts = [torch.cat(self.parts)]
        return self.parts[0]

    def add(self, first: int, rows: torch.Tensor) -> None:
        """Queue ``rows`` of positions ``first, first + 1, ...``; rows not continuing the queue (a
        recompute after preemption) replace it."""
        if self.parts and first == self.first + self.queued:
            self.parts.append(rows)
            self.queued += int(rows.shape[0])
        else:
            self.first, self.parts, self.queued = first, [rows], int(rows.shape[0])

    def take(self, n: int) -> torch.Tensor:
        """Remove and return the first ``n`` queued rows."""
        rows = self.rows
        assert rows is not None
        taken = rows[:n]
        self.parts = [rows[n:]] if n < self.queued else []
        self.queued = max(0, self.queued - n)
        self.first += n
        return taken


@dataclass(slots=True)
class SpecState:
    """One request's speculative decoding state.

    ``draft`` holds the tokens guessed for the next step: fed after the pending ones and verified
    there, not part of ``Sequence.token_ids`` until accepted. ``index`` is None until the request's
    first proposal (requests that never draft build no index).
    """

    draft: list[int] = field(default_factory=list)
    #: The grammar forces tokens right after the whole draft (no bonus token is sampled there).
    forced_after: bool = False
    #: The current draft length (the confidence schedule).
    draft_len: int = 0
    #: Moving average of the request's acceptance rate.
    acceptance: float = INITIAL_ACCEPTANCE
    index: NgramIndex | None = None
    #: Draft tokens verified so far, and how many of them were accepted (reported in metrics).
    num_drafted: int = 0
    num_accepted: int = 0
    #: Where the pending draft came from (a name of ``drafts.base.SOURCES``; empty without one).
    source: str = ""
    #: The request's ``speculative_source``, the guessed sources it allows, and its longest draft.
    mode: str = AUTO
    configured: bool = False
    use_ngram: bool = True
    use_mtp: bool = False
    max_len: int = 0
    #: The MTP confidence schedule (None until the request's first MTP proposal).
    confidence: ConfidenceSchedule | None = None
    #: Per source: [draft tokens verified, accepted, verifications] (reported in metrics).
    by_source: dict[str, list[int]] = field(default_factory=dict)
    #: Acceptance average of the n-gram drafts alone (stands in for their probabilities).
    ngram_acceptance: float = INITIAL_ACCEPTANCE
    #: The pending draft was weighed against its cost when proposed (the scheduler passes it).
    weighed: bool = False
    #: Per MTP module (see the module docstring); empty until the request's first hidden rows.
    mtp: list[MTPQueue] = field(default_factory=list)
    #: Per source, how far the request's drafts survive verification (the ``auto`` policy's record).
    survival: dict[str, Survival] = field(default_factory=dict)

    def record(self, drafted: int, accepted: int, max_len: int) -> None:
        """Account for a verified draft of ``drafted`` tokens of which ``accepted`` were taken: the
        counters (overall and for the draft's source), the n-gram draft length (capped at
        ``max_len``), the source's confidence and the acceptance average."""
        self.num_drafted += drafted
        self.num_accepted += accepted
        if drafted:
            stats = self.by_source.setdefault(self.source, [0, 0, 0])
            stats[0] += drafted
            stats[1] += accepted
            stats[2] += 1
            full = accepted == drafted
            self.draft_len = min(max_len, self.draft_len + 1) if full else max(1, accepted + 1)
            self.acceptance += ACCEPTANCE_EMA * (accepted / drafted - self.acceptance)
            if self.source == "ngram":
                self.ngram_acceptance += ACCEPTANCE_EMA * (accepted / drafted - self.ngram_acceptance)
            elif self.source == "mtp" and self.confidence is not None:
                self.confidence.record(drafted, accepted)

    def add_mtp_rows(self, first: int, rows: torch.Tensor) -> None:
        """Queue main-model hidden ``rows`` of committed positions ``first, first + 1, ...`` for the
        first MTP module (see :meth:`MTPQueue.add`)."""
        if not self.mtp:
            self.mtp.append(MTPQueue())
        self.mtp[0].add(first, rows)

    @property
    def mtp_pos(self) -> int | None:
        """The first MTP module's newest run position (None before it ran)."""
        return self.mtp[0].newest if self.mtp and self.mtp[0].output is not None else None

    def reset_mtp(self) -> None:
        """Forget the MTP state (preemption: the cache is recomputed from the tokens)."""
        self.mtp = []

    def skip(self) -> None:
        """Drop the draft because it does not pay off in this batch; the average moves up so that
        drafting is tried again after a few skipped steps."""
        self.draft = []
        self.acceptance = min(1.0, self.acceptance + SKIP_RECOVERY)


def draft_pays_off(spec: SpecState, batch_size: int) -> bool:
    """Whether ``spec``'s draft is fed in a batch of ``batch_size``: always when it was weighed when
    proposed, else when the acceptance average clears the break-even rate for ``batch_size`` rows."""
    return spec.weighed or spec.acceptance >= batch_size / (batch_size + STEP_COST_IN_ROWS)
