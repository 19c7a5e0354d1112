"""Continuous batching with chunked prefill and preemption by recompute.

Every step has a token budget (``max_num_batched_tokens``). Running sequences are served first, in
arrival order, decoding ones before those mid-prefill: a decoding sequence costs one token (plus
its draft), a sequence mid-prefill costs its next chunk. Whatever budget is left admits waiting
sequences, whose prompt may be cut into a chunk. While any sequence decodes, prefill chunks
(running and admitted together) get at most ``max_prefill_tokens_while_decoding`` tokens per step:
a step's time grows with the tokens it feeds, and every decoding stream waits for the whole step,
so a long prompt is spread over many short steps instead of stalling each stream for seconds. When the
KV pool is exhausted, the newest running sequence is preempted: its blocks are freed and it goes
back to the head of the queue; its generated tokens are kept and re-prefilled when it returns.

A constrained request whose grammar is still compiling waits outside the queue
(``WAITING_FOR_GRAMMAR``); :meth:`Scheduler.take_compiled` hands it back to the engine once its
compile is done (a failed compile ends that request alone), and the engine queues it at the tail
after appending the tokens the grammar fixes at the start. Several uncomputed tokens of a running
sequence (forced tokens appended by jump-forward, or a recompute after preemption) are fed as one
chunk like a prefill.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, wait
from dataclasses import dataclass

from agent_infer.engine.block_manager import BlockManager
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.sequence import FinishReason, Sequence, SequenceStatus
from agent_infer.engine.spec_state import draft_pays_off
from agent_infer.errors import EngineError


@dataclass(frozen=True)
class ScheduledSequence:
    """One sequence's share of a step: tokens ``[start, start + num_new_tokens)`` are fed.

    ``samples`` is True when the chunk reaches the sequence's last token, so a new token is sampled;
    a partial prefill chunk samples nothing. ``draft`` (speculative decoding) is fed after the
    chunk, and each of its tokens gets a logits row of its own for verification.
    """

    seq: Sequence
    start: int
    num_new_tokens: int
    samples: bool
    draft: tuple[int, ...] = ()

    @classmethod
    def of(cls, seq: Sequence, num_new_tokens: int, draft: tuple[int, ...] = ()) -> ScheduledSequence:
        """Schedule the next ``num_new_tokens`` uncomputed tokens of ``seq`` (then ``draft``)."""
        start = seq.num_computed_tokens
        return cls(seq, start, num_new_tokens, start + num_new_tokens == seq.num_tokens, draft)

    @property
    def num_fed_tokens(self) -> int:
        """Tokens this item feeds the model: the chunk plus the draft."""
        return self.num_new_tokens + len(self.draft)


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step runs, plus sequences that ended before running (``failed``: a sequence the
    KV pool can never hold)."""

    scheduled: list[ScheduledSequence]
    preempted: list[Sequence]
    failed: list[Sequence]

    @property
    def num_tokens(self) -> int:
        """Total tokens fed to the model this step (drafts included)."""
        return sum(s.num_fed_tokens for s in self.scheduled)


class Scheduler:
    """Decides, each step, which sequences run and how many tokens each contributes."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_prefill_tokens_while_decoding = config.max_prefill_tokens_while_decoding
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.waiting_for_grammar: list[Sequence] = []
        self.num_preemptions = 0
        #: Prompt tokens the model has run (prefix-cache hits and imported KV are not counted).
        self.num_prompt_tokens_computed = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (held back while ``seq.grammar_future`` is pending)."""
        if seq.grammar_future is not None:
            seq.status = SequenceStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar.append(seq)
            return
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while any sequence compiles its grammar, waits or runs."""
        return bool(self.waiting or self.running or self.waiting_for_grammar)

    def wait_for_grammars(self, timeout: float) -> None:
        """Block up to ``timeout`` s for a compile when nothing else could run (no busy loop)."""
        if self.waiting or self.running or not self.waiting_for_grammar:
            return
        futures = [s.grammar_future for s in self.waiting_for_grammar if s.grammar_future is not None]
        wait(futures, timeout=timeout, return_when=FIRST_COMPLETED)

    def take_compiled(self) -> list[Sequence]:
        """Sequences whose grammar compile ended, in arrival order, taken out of WAITING_FOR_GRAMMAR:
        each has its matcher, or is finished with the compile's error. The caller queues the live
        ones with :meth:`add`."""
        done: list[Sequence] = []
        for seq in list(self.waiting_for_grammar):
            future = seq.grammar_future
            if future is not None and not future.done():
                continue
            self.waiting_for_grammar.remove(seq)
            seq.grammar_future = None
            done.append(seq)
            if future is None:
                continue
            if future.cancelled():  # the pool was shut down under it
                seq.finish(FinishReason.ERROR, "grammar compile was cancelled (engine shutting down)")
                continue
            exc = future.exception()
            if exc is not None:
                seq.finish(FinishReason.ERROR, f"grammar compile failed: {type(exc).__name__}: {exc}")
                continue
            seq.matcher = future.result()
        return done

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch (running sequences first, then admissions)."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted: list[Sequence] = []
        failed: list[Sequence] = []

        # Iterate over a snapshot: preemption removes victims from the tail of ``self.running``.
        # Decoding sequences go first so that prefill chunks can never take their budget.
        decoding = [s for s in self.running if _decoding(s)]
        queue = decoding + [s for s in self.running if not _decoding(s)]
        prefill_budget = self.max_prefill_tokens_while_decoding if decoding else budget
        for seq in queue:
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            pending = seq.num_tokens - seq.num_computed_tokens
            prefilling = not _decoding(seq)
            if prefilling and prefill_budget == 0:
                continue
            num_new = min(pending, budget, prefill_budget) if prefilling else min(pending, budget)
            # A draft is only worth its rows when the request's drafts are accepted often enough
            # for a batch this size.
            if self._fit_draft(seq, num_new, pending, budget) and not draft_pays_off(seq.spec, len(queue)):
                seq.spec.skip()
            while not self.block_manager.can_append(seq):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.block_manager.append(seq, len(seq.spec.draft))
            item = ScheduledSequence.of(seq, num_new, tuple(seq.spec.draft))
            scheduled.append(item)
            budget -= item.num_fed_tokens
            if prefilling:
                prefill_budget -= num_new

        # Admitting new work in the same step as a preemption would just thrash the pool.
        while (
            self.waiting
            and min(budget, prefill_budget) > 0
            and len(self.running) < self.max_num_seqs
            and not preempted
        ):
            seq = self.waiting[0]
            if not self.block_manager.can_allocate(seq):
                if not self.running and not scheduled:
                    # Nothing will ever free blocks for it: the pool is smaller than the sequence.
                    self.waiting.popleft()
                    seq.finish(
                        FinishReason.ERROR,
                        f"sequence of {seq.num_tokens} tokens needs more KV blocks than the pool has "
                        f"({self.block_manager.num_blocks} blocks of {self.block_manager.block_size})",
                    )
                    failed.append(seq)
                    continue
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = time.perf_counter()
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            pending = seq.num_tokens - seq.num_computed_tokens
            num_new = min(pending, budget, prefill_budget)
            prefill_budget -= num_new
            # A draft set before the first pass (the boundary of the grammar's leading forced
            # text) rides along with a prefill that completes in this step.
            draft = self._fit_draft(seq, num_new, pending, budget)
            if draft:
                self.block_manager.append(seq, len(draft))
            item = ScheduledSequence.of(seq, num_new, draft)
            scheduled.append(item)
            budget -= item.num_fed_tokens

        return SchedulerOutput(scheduled, preempted, failed)

    def take_waiting(self, seq: Sequence) -> None:
        """Take the waiting ``seq`` out of the queue with KV blocks for all its tokens (prefix-cache
        hits counted in ``num_computed_tokens``), for its prompt to be computed outside the step
        (context-parallel prefill, ``agent_infer/parallel/cp_engine.py``); :meth:`resume` hands it
        back. The caller checks ``block_manager.can_allocate`` first."""
        self.waiting.remove(seq)
        self.block_manager.allocate(seq)
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = time.perf_counter()
            seq.num_cached_tokens = seq.num_computed_tokens
        seq.status = SequenceStatus.RUNNING

    def resume(self, seq: Sequence, num_computed: int) -> None:
        """Run a sequence taken with :meth:`take_waiting` whose first ``num_computed`` tokens' KV the
        caller wrote into its blocks; the steps feed the rest (at least the last token, which samples)."""
        if not seq.num_computed_tokens <= num_computed < seq.num_tokens:
            raise EngineError(
                f"{seq.request_id!r}: {num_computed} computed tokens of {seq.num_tokens} "
                f"(already {seq.num_computed_tokens})"
            )
        self.num_prompt_tokens_computed += max(
            0, min(num_computed, seq.num_prompt_tokens) - seq.num_computed_tokens
        )
        seq.num_computed_tokens = num_computed
        self.block_manager.register_computed(seq)
        self.running.append(seq)

    def _fit_draft(self, seq: Sequence, num_new: int, pending: int, budget: int) -> tuple[int, ...]:
        """``seq``'s draft if it rides along with a chunk of ``num_new`` of its ``pending`` tokens:
        the chunk reaches the last pending token (the draft's rows follow the sampled one), chunk
        and draft fit the step's ``budget``, and the draft's KV slots need no preemption. Otherwise
        the draft is dropped and the result is empty."""
        draft = seq.spec.draft
        if not draft:
            return ()
        if (
            num_new == pending
            and num_new + len(draft) <= budget
            and self.block_manager.can_append(seq, len(draft))
        ):
            return tuple(draft)
        seq.spec.draft = []
        return ()

    def _preempt(self, seq: Sequence) -> None:
        seq.spec.draft = []
        seq.spec.reset_mtp()
        self.running.remove(seq)
        self.block_manager.deallocate(seq)
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def advance(self, output: SchedulerOutput) -> None:
        """Account for a finished model step: computed tokens grow and full blocks are published."""
        for item in output.scheduled:
            if item.seq.is_finished:  # failed during the step; its blocks are already released
                continue
            seq = item.seq
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                self.num_prompt_tokens_computed += min(
                    item.num_new_tokens, seq.num_prompt_tokens - seq.num_computed_tokens
                )
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.register_computed(seq)
            self.block_manager.release_behind_window(seq)

    def finish(self, seq: Sequence) -> None:
        """Drop a finished sequence from the queues and release its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.waiting_for_grammar:
            self.waiting_for_grammar.remove(seq)
            if seq.grammar_future is not None:
                seq.grammar_future.cancel()  # a compile already running still completes, unused
                seq.grammar_future = None
        if seq.block_table:
            self.block_manager.deallocate(seq)


def _decoding(seq: Sequence) -> bool:
    """Whether ``seq`` is past its prompt: it samples a token every step it runs."""
    return seq.num_computed_tokens >= seq.num_prompt_tokens
