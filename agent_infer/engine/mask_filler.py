"""Token-bitmask filling for one step's constrained rows, optionally overlapped with the forward pass.

With overlap on, the fill is queued on a native thread before the model runs and the engine
joins it right before the masks are needed. The fill runs in C++ without the GIL from start to
end (:mod:`agent_infer.grammar.runtime.step_fill`), so it never holds up the stepping thread's
Python; when every row's grammar states are cached it stays on one thread rather than waking
pool threads that would take cores from the forward pass. The matchers must not change
between :meth:`MaskFiller.start` and the join: the engine accepts tokens only in postprocess,
after sampling, so this holds by construction (a call on a matcher meanwhile raises
:class:`~agent_infer.errors.MatcherBusyError`).
"""

from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING

import torch

from agent_infer.grammar.runtime.step_fill import FillThread, StepFill

if TYPE_CHECKING:
    from agent_infer.grammar.runtime.matcher import GrammarMatcher


class PendingMasks:
    """The bitmask for one step's sampling rows: filling on the fill thread, or filled on demand."""

    def __init__(self, fill: StepFill, order: list[int], background: bool) -> None:
        self._fill = fill
        # Bitmask rows in the order the fill reports them (plain rows, then each draft's rows).
        self._order = order
        self._background = background
        self._restricting: list[int] | None = None
        self._done = False

    @property
    def rows(self) -> list[int]:
        """Every masked row, sorted."""
        return sorted(self._order)

    @property
    def bitmask(self) -> torch.Tensor:
        """The int32 bitmask ``[num_rows, words]`` being filled (rows without a matcher allow everything)."""
        return self._fill.bitmask

    @property
    def fill_seconds(self) -> float:
        """Seconds the fill took (0 until it has run), for the grammar metrics."""
        return self._fill.seconds if self._done else 0.0

    @property
    def restricting(self) -> list[int]:
        """The rows that restrict something, sorted (joins the fill); the others allow every token."""
        return self._join()

    def _join(self) -> list[int]:
        if self._restricting is None:
            flags = self._fill.finish()
            self._done = True
            self._restricting = sorted(row for row, restricts in zip(self._order, flags) if restricts)
        return self._restricting

    def result(self) -> torch.Tensor:
        """The filled bitmask, once the fill is over (it runs here if no thread has it).

        Filled once: later calls (the output projection, then masking) return the same tensor.
        """
        if not self._done:
            self._join()
        return self._fill.bitmask

    def apply_cpu(self, logits: torch.Tensor) -> None:
        """Finish the fill and mask float32 C-contiguous CPU ``logits`` in place, in one native call
        (the rows that allow everything are skipped)."""
        self._fill.apply_cpu(logits)
        self._done = True

    def wait_quietly(self) -> None:
        """Block until a background fill is over, ignoring its outcome (the step is being abandoned)."""
        if self._background:
            # The abandoned step reports its own error; the fill's outcome adds nothing.
            with contextlib.suppress(Exception):
                self._fill.finish()


class MaskFiller:
    """Starts bitmask fills for a step's sampling rows; ``overlap`` runs them on a native thread."""

    def __init__(self, vocab_size: int, *, overlap: bool) -> None:
        self.vocab_size = vocab_size
        self.overlap = overlap
        # Started by the first constrained step, so unconstrained workloads never have it.
        self._thread: FillThread | None = None
        self._stopped = False
        self._lock = threading.Lock()
        self._pool_size: int | None = None  # read from the environment by the first fill
        self._buffer: torch.Tensor | None = None

    def start(
        self, matchers: list[GrammarMatcher | None], drafts: list[tuple[int, ...]] | None = None
    ) -> PendingMasks | None:
        """Begin filling the rows of one step's sampling sequences (None: unconstrained), in order;
        ``drafts[i]`` gives sequence ``i`` one extra row per draft token. None when nothing is constrained."""
        plain: list[GrammarMatcher] = []
        rows: list[int] = []
        chains: list[tuple[GrammarMatcher, int, tuple[int, ...]]] = []
        if drafts is None:
            for row, matcher in enumerate(matchers):
                if matcher is not None:
                    plain.append(matcher)
                    rows.append(row)
            num_rows = len(matchers)
        else:
            num_rows = 0
            for matcher, draft in zip(matchers, drafts):
                if matcher is not None:
                    if draft:
                        chains.append((matcher, num_rows, draft))
                    else:
                        plain.append(matcher)
                        rows.append(num_rows)
                num_rows += 1 + len(draft)
        if not plain and not chains:
            return None
        if self._pool_size is None:
            from agent_infer.grammar.runtime.matcher import pool_settings

            self._pool_size = pool_settings()
        bitmask = self._bitmask(num_rows)
        order = (
            rows + [first + j for _, first, draft in chains for j in range(len(draft) + 1)]
            if chains
            else rows
        )
        # A fill whose grammar states are all cached costs microseconds per row: it stays on one
        # thread, since waking pool threads costs more than that (and, overlapped, takes cores from
        # the forward pass). First visits of states spread over the pool.
        fill = StepFill(plain, rows, chains, bitmask, cached_threads=1, pool_size=self._pool_size)
        thread = (self._thread or self._fill_thread()) if self.overlap else None
        background = thread is not None and thread.submit(fill)
        return PendingMasks(fill, order, background)

    def _bitmask(self, num_rows: int) -> torch.Tensor:
        """``num_rows`` rows of one bitmask reused step after step (allocating and filling a fresh
        tensor costs more than a cached fill); the step's fill writes every row of it. A step's
        bitmask is dead once the step has sampled, before the next step starts."""
        if self._buffer is None or self._buffer.shape[0] < num_rows:
            from agent_infer.grammar.runtime.bitmask import bitmask_words

            capacity = max(num_rows, 2 * (self._buffer.shape[0] if self._buffer is not None else 4))
            self._buffer = torch.empty((capacity, bitmask_words(self.vocab_size)), dtype=torch.int32)
        return self._buffer[:num_rows]

    def _fill_thread(self) -> FillThread | None:
        with self._lock:
            if self._thread is None and not self._stopped:
                self._thread = FillThread()
            return self._thread

    def shutdown(self) -> None:
        """End the fill thread after the fill it runs; later fills run on their caller."""
        with self._lock:
            self._stopped = True
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.stop()
