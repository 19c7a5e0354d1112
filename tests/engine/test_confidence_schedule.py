"""The MTP confidence schedule, driven by a scripted draft source: uncertain or rejected proposals
shorten drafts, accepted ones lengthen them."""

from __future__ import annotations

import itertools

from agent_infer.engine.drafts.base import expected_accepted
from agent_infer.engine.drafts.schedule import INITIAL_ACCEPTANCE, MAX_THRESHOLD, ConfidenceSchedule


class ScriptedSource:
    """Proposes tokens with the given probabilities; a verifier accepts the first ``accepts`` of them."""

    def __init__(self, probs: list[float], accepts: int) -> None:
        self.probs = probs
        self.accepts = accepts

    def step(self, schedule: ConfidenceSchedule, limit: int) -> int:
        length = schedule.length(self.probs, limit)
        schedule.record(length, min(length, self.accepts))
        return length


def test_uncertain_proposals_stop_the_draft() -> None:
    s = ConfidenceSchedule(base=0.3)
    assert s.threshold == 0.3  # at the start value of the acceptance average
    assert s.length([0.9, 0.8, 0.2, 0.9], 5) == 2
    assert s.length([0.1, 0.9], 5) == 0
    assert s.length([0.9] * 8, 5) == 5


def test_rejections_shorten_and_acceptances_lengthen() -> None:
    probs = [0.95, 0.9, 0.8, 0.6, 0.45, 0.4]
    s = ConfidenceSchedule(base=0.3)
    start = s.length(probs, 6)
    rejecting = ScriptedSource(probs, accepts=0)
    lengths = [rejecting.step(s, 6) for _ in range(8)]
    assert lengths[0] == start and lengths[-1] < start
    assert all(b <= a for a, b in itertools.pairwise(lengths))  # never longer while rejected
    assert s.threshold > 0.3
    accepting = ScriptedSource(probs, accepts=6)
    later = [accepting.step(s, 6) for _ in range(12)]
    assert later[-1] == 6 > lengths[-1]
    assert all(b >= a for a, b in itertools.pairwise(later))
    assert s.threshold < 0.3


def test_threshold_is_bounded_and_base_zero_always_drafts() -> None:
    s = ConfidenceSchedule(base=0.9)
    for _ in range(30):
        s.record(5, 0)
    assert s.threshold == MAX_THRESHOLD  # a request can always draft its surest tokens again
    assert ConfidenceSchedule(base=0.0).length([0.0, 0.01], 5) == 2
    assert ConfidenceSchedule(base=0.3).acceptance == INITIAL_ACCEPTANCE


def test_expected_accepted_tokens() -> None:
    assert expected_accepted([]) == 0.0
    assert expected_accepted([1.0, 1.0]) == 2.0
    assert abs(expected_accepted([0.5, 0.5]) - 0.75) < 1e-12
