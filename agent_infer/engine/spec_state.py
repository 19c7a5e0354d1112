"""What speculative decoding keeps per request (``Sequence.spec``): its draft, n-gram index and confidence.

A prompt-lookup draft's length follows an acceptance schedule per request: it starts at the
request's maximum draft length, grows by one after a fully accepted draft and shrinks to one more
than the accepted prefix after a rejection; an MTP draft's length follows the confidence schedule
(:mod:`agent_infer.engine.drafts.schedule`). Whether a draft is fed at all depends on the
batch: a draft token costs one more row in the forward pass, while an accepted one saves its
request a step, whose fixed cost is shared by the whole batch. With a step of ``B`` rows costing
``a + b·B`` (on CPU, SmolLM2-135M: a ≈ 14 ms, b ≈ 2.4 ms), drafting pays off when a request's
acceptance rate exceeds ``B / (B + a/b)``: 14% alone, 57% among eight. Each request keeps a moving
average of its acceptance rate; the scheduler drops drafts below the threshold for the current
batch and nudges the average up (:meth:`SpecState.skip`), so a request that stopped drafting is
tried again later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from agent_infer.engine.drafts.base import AUTO
from agent_infer.engine.drafts.ngram import NgramIndex
from agent_infer.engine.drafts.schedule import ConfidenceSchedule

#: Fixed cost of a forward step over the cost of one more row (``a/b`` in the module docstring).
#: Measured on CPU; on accelerators extra rows are relatively cheaper, so this is conservative.
STEP_COST_IN_ROWS = 6.0
#: Weight of the newest draft in a request's acceptance average, and the average's start value.
ACCEPTANCE_EMA = 0.3
INITIAL_ACCEPTANCE = 0.6
#: How far a skipped draft moves the average back up (retry after a few skipped steps).
SKIP_RECOVERY = 0.05


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
    #: MTP state: main-model hidden rows of committed positions not yet fed to the MTP module
    #: (``mtp_rows`` from position ``mtp_first``); then the MTP output at its newest position
    #: ``mtp_pos`` (hidden state and logits), from which the next MTP draft is chained.
    mtp_first: int = 0
    mtp_rows: torch.Tensor | None = None
    mtp_pos: int | None = None
    mtp_hidden: torch.Tensor | None = None
    mtp_logits: torch.Tensor | None = None

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
        MTP module; rows not continuing the queue (a recompute after preemption) replace it."""
        if self.mtp_rows is not None and first == self.mtp_first + int(self.mtp_rows.shape[0]):
            self.mtp_rows = torch.cat((self.mtp_rows, rows))
        else:
            self.mtp_first, self.mtp_rows = first, rows

    def reset_mtp(self) -> None:
        """Forget the MTP state (preemption: the cache is recomputed from the tokens)."""
        self.mtp_rows = self.mtp_hidden = self.mtp_logits = None
        self.mtp_pos = None

    def skip(self) -> None:
        """Drop the draft because it does not pay off in this batch; the average moves up so that
        drafting is tried again after a few skipped steps."""
        self.draft = []
        self.acceptance = min(1.0, self.acceptance + SKIP_RECOVERY)


def draft_pays_off(spec: SpecState, batch_size: int) -> bool:
    """Whether ``spec``'s acceptance average clears the break-even rate for ``batch_size`` rows."""
    return spec.acceptance >= batch_size / (batch_size + STEP_COST_IN_ROWS)
