"""The ``auto`` draft policy: per request and step, the source and draft length that pay most.

For each request the policy weighs its guessed sources (prompt lookup, when the lookup found a
continuation; MTP, when the checkpoint has MTP layers) by their best net gain
(:meth:`~.cost.CostModel.best_length`): what the request's drafts from that source are expected to
keep (:mod:`.survival`: the request's own record, leaning on the engine's) less what the draft's rows
and the source's passes cost the batch (an MTP draft of ``n`` tokens: ``n + 1`` passes, the catch-up
of the rows the last step committed included). MTP runs only for the requests it is chosen for, capped at
its best length, since its passes are the cost; prompt lookup's draft is cut to its best length.
Rows are counted as the batch's drafts are chosen, so a draft that starts a new chunk of padded rows
is charged for it. Prompt-lookup tokens of the requests not running MTP are then chosen across the
batch, surest first (:meth:`DraftPolicy._fill`): the free rows of the last padded chunk take any,
and a further chunk is fed only when the chances of its tokens add up to more than it costs, so in
a big batch a few sure tokens still ride along. A grammar-forced draft (certain) is cut only where
its rows stop paying.

After MTP ran, its draft (maybe shorter: the confidence schedule stops it early) is fed unless the
prompt-lookup draft gains more; the passes are spent by then and count no more.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent_infer.engine.drafts.base import MTP, NGRAM, Draft
from agent_infer.engine.drafts.cost import CostModel
from agent_infer.engine.drafts.survival import IDLE_DECAY, Survival
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

    def plan(self, candidates: list[Candidate], batch: int, rows: int, mtp: bool, idle: int = 0) -> None:
        """Decide which candidates run MTP and how far (``mtp_limit``), then choose the others'
        prompt-lookup tokens batch-wide (:meth:`_fill`); ``rows`` is the step's rows before these
        drafts, ``idle`` the steps sat out since the last plan (the records fade for each)."""
        drafting = sum(1 for c in candidates if mtp and c.seq.spec.use_mtp)
        running = rows
        for _ in range(_ROUNDS):
            running = rows
            chosen = 0
            for c in candidates:
                c.rows = running
                c.mtp_limit = 0
                best = self._ngram(c, batch, running)
                if mtp and c.seq.spec.use_mtp:
                    # A round runs one pass per token and one more: the catch-up of the rows the
                    # last step committed, which a request not drafting defers and batches.
                    per_pass = self.cost.pass_cost(MTP, drafting)
                    n, gain = self.cost.best_length(
                        self.curve(c.seq, MTP, c.limit), batch, running, per_token=per_pass, fixed=per_pass
                    )
                    if n and gain > best:
                        c.mtp_limit = n
                        chosen += 1
                        running += n
            if chosen == drafting or not chosen:
                break
            drafting = chosen
        self._fill([c for c in candidates if not c.mtp_limit], batch, running)
        self._fade(candidates, mtp, IDLE_DECAY ** (1 + idle))

    def _fade(self, candidates: list[Candidate], mtp: bool, factor: float) -> None:
        """Fade the records of the sources a candidate could have drafted from but was not fed
        (the engine's too, when no candidate fed it) by ``factor``."""
        could = {MTP: False, NGRAM: False}
        fed = {MTP: False, NGRAM: False}
        for c in candidates:
            spec = c.seq.spec
            for source, possible, used in (
                (MTP, mtp and spec.use_mtp, bool(c.mtp_limit)),
                (NGRAM, c.lookup is not None, c.ngram is not None),
            ):
                if not possible:
                    continue
                could[source] = True
                fed[source] = fed[source] or used
                if not used and source in spec.survival:
                    spec.survival[source].forget(factor)
        for source in (MTP, NGRAM):
            if could[source] and not fed[source]:
                self.survival[source].forget(factor)

    def _fill(self, candidates: list[Candidate], batch: int, rows: int) -> None:
        """Choose the candidates' prompt-lookup tokens across the batch, surest first: the free rows
        of the step's last padded chunk take any, a further chunk only tokens whose chances of being
        kept add up to more than the chunk costs the batch (in tokens). A request's first token
        also pays for the request's switch to a draft (``d`` of :mod:`.cost`), or is passed over
        with the rest of its draft."""
        ranked: list[tuple[float, int, int]] = []
        for j, c in enumerate(candidates):
            c.ngram, c.ngram_gain = None, 0.0
            if c.lookup is not None:
                ranked += [(s, j, i) for i, s in enumerate(self.curve(c.seq, NGRAM, len(c.lookup)))]
        if not ranked:
            return
        # Chances fall along a draft, so taking the surest tokens first keeps every draft a prefix.
        ranked.sort(key=lambda t: (-t[0], t[1], t[2]))
        taken = [0] * len(candidates)
        gains = [0.0] * len(candidates)
        line = self.cost.step_line()
        step = self.cost.step_time(rows)
        if line is None or step is None or step <= 0.0:
            chosen = ranked
        else:
            width = self.cost.row_multiple
            chunk = batch * line[1] * width / step
            switch = batch * self.cost.per_draft() / step
            free = self.cost.pad(rows) - rows
            chosen = []
            passed: set[int] = set()
            group: list[tuple[float, int, int]] = []
            for token in ranked:
                s, j, i = token
                if j in passed:
                    continue
                if free > 0:
                    if i == 0 and s <= switch:
                        passed.add(j)
                        continue
                    chosen.append(token)
                    free -= 1
                    continue
                group.append(token)
                if len(group) == width:
                    newcomers = sum(1 for _, g, k in group if k == 0)
                    if sum(t[0] for t in group) <= chunk + switch * newcomers:
                        break
                    chosen += group
                    group = []
        for s, j, _ in chosen:
            taken[j] += 1
            gains[j] += s
        for j, c in enumerate(candidates):
            if taken[j] and c.lookup is not None:
                n = taken[j]
                c.ngram, c.ngram_gain = Draft(NGRAM, c.lookup.tokens[:n], c.lookup.probs[:n]), gains[j]

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
