"""What the engine hands back for a request: text, tokens, finish reason, logprobs and timings."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, TypeVar

from agent_infer.engine.sequence import FinishReason, Sequence


@dataclass(frozen=True)
class DraftStats:
    """One draft source's share of a request's speculative decoding: draft tokens verified, how
    many were accepted, and how many verifications (steps that fed a draft from it) there were."""

    drafted: int
    accepted: int
    verifications: int

    @property
    def mean_accepted_length(self) -> float:
        """Accepted draft tokens per verification (0 without any)."""
        return self.accepted / self.verifications if self.verifications else 0.0


@dataclass(frozen=True)
class RequestMetrics:
    """Timings in seconds (``time.perf_counter`` clock), preemptions, and how many output tokens
    the grammar forced (appended by jump-forward without sampling) or the engine wrote to close
    the document within ``max_tokens`` (``SamplingParams.close_on_length``); with speculative
    decoding, how many draft tokens were verified and how many of them were accepted."""

    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int
    num_forced_tokens: int = 0
    num_closing_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    #: The same per draft source (``"mtp"``, ``"ngram"``, ``"forced"``), sources never fed left out.
    draft_sources: dict[str, DraftStats] = field(default_factory=dict)

    @property
    def time_to_first_token(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(frozen=True)
class CompletionOutput:
    """The generated part of a request. ``finish_reason`` is None while it is still running.

    ``logprobs`` has one ``{token_id: logprob}`` per generated token (the sampled token plus the
    requested top-n alternatives) when the request asked for logprobs, else None. ``error`` says
    what went wrong when ``finish_reason == "error"``.
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None
    error: str | None = None
    #: For a finished JSON-constrained request: the decoded JSON value, or an instance of the
    #: Pydantic model the request was constrained by. None when the text did not finish.
    parsed: Any = None
    #: Why ``parsed`` is None for a finished JSON request (e.g. a Pydantic validator beyond the schema).
    parse_error: str | None = None

    @property
    def finished(self) -> bool:
        """True once the request has stopped generating."""
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    """One request's state after a step (or its final result from :meth:`LLM.generate`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int
    metrics: RequestMetrics

    @property
    def finished(self) -> bool:
        """True once every completion has stopped."""
        return all(o.finished for o in self.outputs)

    @property
    def text(self) -> str:
        """The first completion's text."""
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        """The first completion's token ids."""
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        """The first completion's finish reason: stop, length, abort, error, or None if running."""
        return self.outputs[0].finish_reason

    @classmethod
    def from_sequence(cls, seq: Sequence) -> RequestOutput:
        """Snapshot ``seq`` (lists are copied so later steps do not mutate the snapshot)."""
        m = seq.metrics
        parsed, parse_error = _parse(seq)
        spec = seq.spec
        completion = _frozen(
            CompletionOutput,
            text=seq.output_text,
            token_ids=seq.output_token_ids,
            finish_reason=seq.finish_reason.value if seq.finish_reason is not None else None,
            logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
            error=seq.error,
            parsed=parsed,
            parse_error=parse_error,
        )
        metrics = _frozen(
            RequestMetrics,
            arrival_time=m.arrival_time,
            first_scheduled_time=m.first_scheduled_time,
            first_token_time=m.first_token_time,
            finished_time=m.finished_time,
            num_preemptions=m.num_preemptions,
            num_forced_tokens=seq.num_forced_tokens,
            num_closing_tokens=seq.num_closing_tokens,
            num_draft_tokens=spec.num_drafted,
            num_accepted_draft_tokens=spec.num_accepted,
            draft_sources={name: DraftStats(*counts) for name, counts in spec.by_source.items()},
        )
        return _frozen(
            cls,
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            num_cached_tokens=seq.num_cached_tokens,
            metrics=metrics,
        )


_T = TypeVar("_T")


def _frozen(cls: type[_T], **fields: Any) -> _T:
    """An instance of the frozen dataclass ``cls`` (no ``__post_init__``) holding ``fields``, which
    must name every field.

    A frozen dataclass's generated ``__init__`` sets each field through ``object.__setattr__``,
    0.2-0.4 us a field on CPython 3.11; the engine snapshots every running sequence each step, 23
    fields in three objects (test_output_snapshot.py checks the result equals the constructors')."""
    obj = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


def _parse(seq: Sequence) -> tuple[Any, str | None]:
    """Parse a finished JSON-constrained output; (None, reason) when it cannot be parsed."""
    structured = seq.params.structured
    if structured is None or not structured.is_json or seq.finish_reason is not FinishReason.STOP:
        return None, None
    try:
        value = json.loads(seq.output_text)
    except json.JSONDecodeError as exc:
        return None, f"output is not JSON: {exc}"
    if structured.model is None:
        return value, None
    try:
        return structured.model.model_validate(value), None
    except Exception as exc:  # pydantic.ValidationError: validators beyond what the schema states
        return None, f"{type(exc).__name__}: {exc}"
