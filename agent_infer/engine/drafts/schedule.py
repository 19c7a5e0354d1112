"""The confidence schedule: how far a request's MTP draft extends.

The MTP head gives, at each draft position, its own probability ``p`` of the token it proposes. A
draft stops before the first proposal with ``p`` below the request's threshold, so confident runs
are drafted long and uncertain ones are verified at once. The threshold adapts to the request's
recent acceptance ``a`` (a moving average of accepted / drafted): ``base * a0 / a``, clamped to
``[0, MAX_THRESHOLD]``, where ``a0`` is the average's start value. Drafts that verification keeps
lower the bar (longer drafts); drafts it rejects raise it (shorter drafts, down to none), since a
head whose proposals are rejected is over-confident for this request's text.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The threshold never rises above this, so a request can always draft its surest tokens again.
MAX_THRESHOLD = 0.95
#: Start value of a request's acceptance average, and the weight of the newest draft in it.
INITIAL_ACCEPTANCE = 0.6
ACCEPTANCE_EMA = 0.3
#: Lowest acceptance the threshold divides by (keeps it finite after a run of rejections).
MIN_ACCEPTANCE = 0.05


@dataclass(slots=True)
class ConfidenceSchedule:
    """One request's confidence threshold (``base`` from ``speculative_confidence``)."""

    base: float
    acceptance: float = INITIAL_ACCEPTANCE

    @property
    def threshold(self) -> float:
        """The probability a proposal needs to extend the draft."""
        return min(MAX_THRESHOLD, self.base * INITIAL_ACCEPTANCE / max(self.acceptance, MIN_ACCEPTANCE))

    def extends(self, prob: float) -> bool:
        """Whether a proposal of probability ``prob`` extends the draft."""
        return prob >= self.threshold

    def length(self, probs: list[float], limit: int) -> int:
        """How many leading proposals (of probabilities ``probs``) to draft, at most ``limit``."""
        n = 0
        for p in probs[:limit]:
            if not self.extends(p):
                break
            n += 1
        return n

    def record(self, drafted: int, accepted: int) -> None:
        """Account for a verified draft of ``drafted`` tokens of which ``accepted`` were kept."""
        if drafted:
            self.acceptance += ACCEPTANCE_EMA * (accepted / drafted - self.acceptance)
