"""Whether the ``auto`` policy plans drafts this step: planning must pay for itself.

Planning a step's guessed drafts (a prompt lookup, survival curves and best lengths per request,
:mod:`.policy`) costs host time every step, whether or not it feeds anything. That time is the
batch's too: ``t`` seconds of planning cost the batch ``B·t / T(R)`` tokens, the tokens its step of
``R`` rows (:mod:`.cost`) would have made in that time. A plan's worth is the net gain of the drafts
it chose (expected kept tokens less their rows and MTP passes, already in tokens). The gate keeps
moving averages of both (weight :data:`WEIGHT` per plan; the worth starts at
:data:`INITIAL_WORTH`, so planning is presumed to pay until plans show otherwise). While the average
worth does not exceed the average cost, the policy sits out the next 1, 2, 4, ... steps after each
plan (at most :data:`MAX_BACKOFF`; requests then feed only grammar-forced drafts, which need no
plan); a plan that lifts the worth above the cost, or a batch of another size (requests that
finished or joined: drafts may pay now), ends the back-off at once. So a batch in which drafts do not pay costs a plan
every :data:`MAX_BACKOFF` steps, and one in which they do plans every step.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Longest run of steps sat out between two plans.
MAX_BACKOFF = 32
#: Weight of the newest plan in the averages, and the worth (tokens) presumed before any plan.
WEIGHT = 0.2
INITIAL_WORTH = 1.0


@dataclass
class PlanGate:
    """The back-off state of one engine's ``auto`` planning (see the module docstring)."""

    backoff: int = 0
    wait: int = 0
    batch: int = 0
    #: Steps sat out since the last plan (the survival records fade for each, as on a plan's step).
    idle: int = 0
    worth: float = INITIAL_WORTH
    cost: float = 0.0

    def open(self, batch: int) -> bool:
        """Whether to plan for a step of ``batch`` requests (counts a sat-out step)."""
        if batch != self.batch:
            self.backoff = self.wait = 0
        self.batch = batch
        if self.wait > 0:
            self.wait -= 1
            self.idle += 1
            return False
        return True

    def take_idle(self) -> int:
        """Steps sat out since the last plan (and restart the count)."""
        idle, self.idle = self.idle, 0
        return idle

    def settle(self, worth: float, cost: float) -> None:
        """Account for a plan whose drafts are worth ``worth`` tokens and that cost ``cost`` tokens."""
        self.worth += WEIGHT * (worth - self.worth)
        self.cost += WEIGHT * (cost - self.cost)
        if self.worth > self.cost:
            self.backoff = self.wait = 0
        else:
            self.backoff = min(MAX_BACKOFF, max(1, 2 * self.backoff))
            self.wait = self.backoff
