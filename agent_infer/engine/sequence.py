"""One request's token stream and its progress through the engine."""

from __future__ import annotations

import enum
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from agent_infer.engine.spec_state import SpecState
from agent_infer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from agent_infer.engine.value_loops import ValueScanner
    from agent_infer.grammar.runtime.matcher import GrammarMatcher


class SequenceStatus(enum.Enum):
    """Where a sequence is: compiling its grammar, waiting for KV blocks, running, or done."""

    WAITING_FOR_GRAMMAR = "waiting_for_grammar"
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a finished sequence stopped; the value is what outputs report."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class SequenceMetrics:
    """Wall-clock timestamps (``time.perf_counter``) of a request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


class Sequence:
    """A request's prompt plus generated tokens, KV block table and decoding state.

    ``num_computed_tokens`` counts tokens whose KV is in the cache (prefix-cache hits included);
    the scheduler feeds the model ``token_ids[num_computed_tokens:]`` in chunks. ``num_cached_tokens``
    is how many prompt tokens the first admission found in the prefix cache (reported to users).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        generator: torch.Generator | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading blocks already published to the prefix cache
        self.num_released_blocks = 0  # leading blocks released behind a sliding window (stale ids)
        self.generator = generator
        # Grammar state of a constrained request (None when unconstrained); it advances with every
        # sampled token and survives preemption, since generated tokens are kept and re-prefilled.
        self.matcher: GrammarMatcher | None = None
        # The matcher being built by the grammar worker pool while the status is WAITING_FOR_GRAMMAR.
        self.grammar_future: Future[GrammarMatcher] | None = None
        # What the constraint's lowering ignored (annotations, and in non-strict mode the keywords
        # it could not enforce), each with its JSON pointer: ``Grammar.warnings``.
        self.constraint_warnings: tuple[str, ...] = ()
        self.num_forced_tokens = 0  # output tokens appended by jump-forward, not sampled
        self.num_closing_tokens = 0  # output tokens appended to close within max_tokens
        self.spec = SpecState()  # speculative decoding: draft, n-gram index, confidence
        # The output scanned as JSON for the value-loop closing bias (engine/value_loops.py).
        self.value_scanner: ValueScanner | None = None
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.output_text = ""
        # Incremental detokenization state: text is decoded from ``prefix_offset`` so multi-token
        # characters (byte-level BPE) are only emitted once complete.
        self.prefix_offset = 0
        self.read_offset = 0
        self.stop_checked_len = 0  # length of output_text already searched for stop strings
        self.metrics = SequenceMetrics(arrival_time=time.perf_counter())

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt's token ids (a copy)."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The generated token ids (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        """The newest token (the next decode step's input)."""
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        """True once the sequence has a finish reason."""
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Record a newly sampled token."""
        self.token_ids.append(token_id)

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """Mark the sequence finished; its blocks are released by the scheduler."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        self.metrics.finished_time = time.perf_counter()
