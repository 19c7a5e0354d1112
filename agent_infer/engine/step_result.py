"""What running a scheduled batch produced, handed from the executor to the postprocessor."""

from __future__ import annotations

from dataclasses import dataclass

from agent_infer.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class SampledTokens:
    """The tokens one sequence gains from a step, in order.

    Without a draft that is one sampled token. With a draft it is the accepted draft prefix
    (``num_accepted_draft`` tokens, whose KV the step already wrote) and then, usually, one token
    of the model's own. ``logprobs`` is the sampled token's entry when the request asked for
    logprobs (requests with a draft never do).
    """

    token_ids: list[int]
    logprobs: dict[int, float] | None = None
    num_accepted_draft: int = 0


@dataclass(frozen=True, slots=True)
class StepResult:
    """Per sampling sequence of the batch, its :class:`SampledTokens`; per sequence whose forward
    pass or sampling raised, the exception (it fails alone, the rest of the batch goes on)."""

    sampled: dict[Sequence, SampledTokens]
    errors: dict[Sequence, BaseException]
