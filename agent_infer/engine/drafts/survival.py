"""How far a source's drafts survive verification: the chance that draft token ``i`` is kept.

Verification keeps a draft's longest prefix the model agrees with, so what a draft of ``n`` tokens
is worth is ``sum_{i <= n} S_i``, with ``S_i`` the chance its first ``i`` tokens are all kept. A
:class:`Survival` estimates, per position ``i``, the chance token ``i`` is kept given the ones
before it were (``p_i``; ``S_i = p_1 ... p_i``), from verified drafts: a draft of ``D`` tokens of
which ``A`` were kept counts one trial at each position ``i <= min(D, A + 1)`` and a success at each
``i <= A``. Counts decay by :data:`DECAY` per draft, so the estimate follows the text being written.

A request's estimate leans on its engine's (the prior, worth :data:`PRIOR_WEIGHT` drafts) until it
has verified drafts of its own. A record also fades while its source is not fed (:meth:`Survival.forget`,
:data:`IDLE_DECAY` per step), so an estimate that once turned a source off drifts back to the prior
and the source is tried again: what is never tried cannot show it got better.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Weight an estimate keeps per new verified draft.
DECAY = 0.9
#: How many drafts the prior counts for at each position.
PRIOR_WEIGHT = 2.0
#: The chance assumed at a position nothing was verified at yet.
UNSEEN = 0.5
#: Weight a record keeps per step its source could draft but was not fed.
IDLE_DECAY = 0.97


@dataclass
class Survival:
    """Per-position keep chances of one source's drafts (see the module docstring)."""

    trials: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)

    def record(self, drafted: int, accepted: int) -> None:
        """Account for a verified draft of ``drafted`` tokens of which ``accepted`` were kept."""
        if drafted <= 0:
            return
        reach = min(drafted, accepted + 1)
        while len(self.trials) < reach:
            self.trials.append(0.0)
            self.kept.append(0.0)
        for i in range(len(self.trials)):
            self.trials[i] *= DECAY
            self.kept[i] *= DECAY
        for i in range(reach):
            self.trials[i] += 1.0
            if i < accepted:
                self.kept[i] += 1.0

    def forget(self, factor: float = IDLE_DECAY) -> None:
        """Fade the record by ``factor`` (a step its source was not fed)."""
        self.trials = [t * factor for t in self.trials]
        self.kept = [k * factor for k in self.kept]

    def chances(self, length: int, prior: Survival | None = None) -> list[float]:
        """``p_1 .. p_length``, each blended with ``prior``'s (itself at :data:`UNSEEN` where it has
        nothing)."""
        bases = prior.chances(length) if prior is not None else [UNSEEN] * length
        weight = PRIOR_WEIGHT if prior is not None else 1.0
        out = []
        for i, base in enumerate(bases):
            n = self.trials[i] if i < len(self.trials) else 0.0
            k = self.kept[i] if i < len(self.kept) else 0.0
            out.append((k + weight * base) / (n + weight))
        return out

    def curve(self, length: int, prior: Survival | None = None) -> list[float]:
        """``S_1 .. S_length``: the chance the first ``i`` tokens are all kept."""
        run, out = 1.0, []
        for p in self.chances(length, prior):
            run *= p
            out.append(run)
        return out
