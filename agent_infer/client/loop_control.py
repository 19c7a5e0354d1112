"""Loop control for SDK calls: the DRY penalty, value-loop and closing-pressure settings a call
decodes with, and how a retry after a ``length`` failure changes them.

``loop_control=None`` (every method's default) means: on for constrained local calls (a schema,
regex, choice, grammar or tools) with :data:`STRUCTURED_LOOP_CONTROL`, off for free text, and
nothing sent to a remote server (``dry_*`` fields are an extension other servers may reject).
``False`` turns it off; a :class:`LoopControl` is used as given, locally and remotely.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from agent_infer.errors import InvalidRequestError
from agent_infer.sampling_params import SamplingParams


@dataclass(frozen=True)
class LoopControl:
    """DRY settings, named as in :class:`~agent_infer.SamplingParams` (llama.cpp's ``dry_*``), the
    value-loop closing bias (``value_close_multiplier``/``_allowed``, ``engine/value_loops.py``) and
    the closing pressure near ``max_tokens`` (``value_close_budget``/``_bias``,
    ``engine/budget_close.py``), which applies only to calls no retry follows (see :func:`resolve`)."""

    dry_multiplier: float = 0.8
    dry_base: float = 1.75
    dry_allowed_length: int = 3
    dry_sequence_breakers: tuple[str, ...] = ()
    dry_penalty_last_n: int = -1
    dry_skip_whitespace: bool = True
    value_close_multiplier: float = 1.0
    value_close_allowed: int = 4
    value_close_budget: float = 0.25
    value_close_budget_bias: float = 8.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dry_sequence_breakers", tuple(self.dry_sequence_breakers))
        # The engine's validation, so a bad value fails at the call with the field named.
        SamplingParams(**self.sampling_fields())

    def sampling_fields(self) -> dict[str, Any]:
        """The ``dry_*`` keyword arguments of :class:`~agent_infer.SamplingParams` (and of the server)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def escalated(self) -> LoopControl:
        """The settings of a retry after a ``length`` failure: twice the DRY multiplier (at least
        0.8), repeats penalized one token earlier, and twice the value-closing bias (at least 1)."""
        return dataclasses.replace(
            self,
            dry_multiplier=max(2 * self.dry_multiplier, 0.8),
            dry_allowed_length=max(self.dry_allowed_length - 1, 2),
            value_close_multiplier=max(2 * self.value_close_multiplier, 1.0),
        )


#: What constrained local calls decode with unless told otherwise (see docs/sdk.md for the numbers).
STRUCTURED_LOOP_CONTROL = LoopControl()

LoopControlOption = LoopControl | bool | None


def check_loop_control(value: object) -> None:
    """``loop_control`` must be None, a bool or a :class:`LoopControl`."""
    if value is not None and not isinstance(value, bool | LoopControl):
        raise InvalidRequestError(
            f"loop_control must be None, a bool or a LoopControl, got {type(value).__name__}",
            field="loop_control",
        )


def resolve(
    option: LoopControlOption, structured: bool, escalation: int = 0, retried: bool = False
) -> LoopControl | None:
    """The settings a local call decodes with (None: off), escalated ``escalation`` times (retries
    after a ``length`` failure); an explicit ``False`` stays off. ``retried``: a ``length`` failure
    of this call is retried, so the closing pressure near ``max_tokens`` is left off."""
    if isinstance(option, LoopControl):
        chosen = option
    elif option is False or (option is None and not structured):
        return None
    else:
        chosen = STRUCTURED_LOOP_CONTROL
    for _ in range(escalation):
        chosen = chosen.escalated()
    if retried and chosen.value_close_budget:
        chosen = dataclasses.replace(chosen, value_close_budget=0.0)
    return chosen
