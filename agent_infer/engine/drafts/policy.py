"""The ``auto`` draft policy: per request and step, the source and draft length that pay most.

For each request the policy weighs its guessed sources (prompt lookup, when the lookup found a
continuation; MTP, when the checkpoint has MTP layers) by their best net gain
(:meth:`~.cost.CostModel.best_length`): what the request's drafts from that source are expected to
keep (:mod:`.survival`: the request's own record, leaning on the engine's) less what the draft's rows
and the source's passes cost the batch. MTP runs only for the requests it is chosen for, capped at
its best length, since its passes are the cost; prompt lookup's draft is cut to its best length.
Rows are counted as the batch's drafts are chosen, so a draft that starts a new chunk of padded rows
is charged for it. A grammar-forced draft (certain) is cut only where its rows stop paying.

After MTP ran, its draft (maybe shorter: the confidence schedule stops it early) is fed unless the
prompt-lookup draft gains more; the passes are spent by then and count no more.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent_infer.engine.drafts.base import MTP, NGRAM, Draft
from agent_infer.engine.drafts.cost import CostModel
from agent_infer.engine.drafts.survival import Survival
from agent_infer.engine.sequence import Sequence

#: Rounds of choosing MTP requests (each round charges the passes to the requests left).
_ROUNDS = 3


@dataclass
class Candidate:
    """A request's choices this step: its room for a draft, what prompt lookup found (``lookup``)
    and, once the policy decided, that draft cut to its best length (``ngram``), how long an MTP
    draft to run (``mtp_limit``, 0: none), the MTP draft itself, and the step's rows before it."""

    seq: Sequence
    limit: int
    lookup: Draft | None = None
    ngram: Draft | None = None
    ngram_gain: float = 0.0
    mtp_limit: int = 0
    mtp: Draft | None = None
    rows: int = 0


class DraftPolicy:
    """Chooses drafts by net gain with the engine's costs and survival records."""

    def __init__(self, row_multiple: int) -> None:
        self.cost = CostModel(row_multiple)
        #: The engine's record per source: a request's leans on it until it has its own.
        self.survival: dict[str, Survival] = {NGRAM: Survival(), MTP: Survival()}

    def curve(self, seq: Sequence, source: str, length: int) -> list[float]:
        """``S_1 .. S_length`` of ``seq``'s drafts from ``source``."""
        own = seq.spec.survival.get(source)
        prior = self.survival[source]
        return own.curve(length, prior) if own is not None else prior.curve(length)

    def record(self, seq: Sequence, source: str, drafted: int, accepted: int) -> None:
        """Account for a verified (or empty) draft of ``source`` in the request's and engine's records."""
        if source not in self.survival:
            return
        self.survival[source].record(drafted, accepted)
        seq.spec.survival.setdefault(source, Survival()).record(drafted, accepted)

    def plan(self, candidates: list[Candidate], batch: int, rows: int, mtp: bool) -> None:
        """Cut each candidate's prompt-lookup draft to its best length and decide which candidates
        run MTP and how far (``mtp_limit``); ``rows`` is the step's rows before these drafts."""
        drafting = sum(1 for c in candidates if mtp and c.seq.spec.use_mtp)
        for _ in range(_ROUNDS):
            running = rows
            chosen = 0
            for c in candidates:
                c.rows = running
                c.mtp_limit = 0
                best = self._ngram(c, batch, running)
                if mtp and c.seq.spec.use_mtp:
                    per_pass = self.cost.pass_cost(MTP, drafting)
                    n, gain = self.cost.best_length(
                        self.curve(c.seq, MTP, c.limit), batch, running, per_token=per_pass
                    )
                    if n and gain > best:
                        c.mtp_limit, best = n, gain
                        chosen += 1
                        running += n
                        continue
                if c.ngram is not None and c.ngram_gain > 0.0:
                    running += len(c.ngram)
            if chosen == drafting or not chosen:
                return
            drafting = chosen

    def _ngram(self, c: Candidate, batch: int, rows: int) -> float:
        """Cut ``c``'s prompt-lookup draft to its best length; its gain (0 without one)."""
        draft = c.lookup
        if draft is None:
            c.ngram, c.ngram_gain = None, 0.0
            return 0.0
        n, gain = self.cost.best_length(self.curve(c.seq, NGRAM, len(draft)), batch, rows)
        c.ngram = Draft(NGRAM, draft.tokens[:n], draft.probs[:n]) if n else None
        c.ngram_gain = gain
        return gain

    def settle(self, c: Candidate, batch: int) -> Draft | None:
        """The draft ``c`` feeds: its MTP draft unless the prompt-lookup one gains more."""
        mtp = c.mtp
        if mtp is not None and mtp.tokens:
            curve = self.curve(c.seq, MTP, len(mtp))
            n, gain = self.cost.best_length(curve, batch, c.rows)
            if n and gain >= c.ngram_gain:
                return Draft(MTP, mtp.tokens[:n], mtp.probs[:n])
        if c.ngram is not None and c.ngram.tokens and c.ngram_gain > 0.0:
            return c.ngram
        return None

    def forced(self, draft: Draft, batch: int, rows: int) -> Draft:
        """A grammar-forced draft cut where its (certain) tokens stop paying for their rows."""
        n, _ = self.cost.best_length([1.0] * len(draft), batch, rows)
        return draft if n == len(draft) else Draft(draft.source, draft.tokens[:n], draft.probs[:n])
