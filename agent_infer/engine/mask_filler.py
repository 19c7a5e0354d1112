"""Token-bitmask filling for one step's constrained rows, optionally overlapped with the forward pass.

With overlap on, the fill starts on a background thread before the model runs and the engine
joins it right before sampling; the native fill releases the GIL, so it proceeds while torch
computes. The matchers must not change between :meth:`MaskFiller.start` and the join: the
engine accepts tokens only in postprocess, after sampling, so this holds by construction.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from agent_infer.grammar.runtime.matcher import GrammarMatcher


class PendingMasks:
    """The bitmask for one step's sampling rows: already filling in the background, or filled on demand."""

    def __init__(
        self,
        matchers: list[GrammarMatcher],
        rows: list[int],
        num_rows: int,
        vocab_size: int,
        executor: ThreadPoolExecutor | None,
        drafted: list[tuple[GrammarMatcher, int, tuple[int, ...]]] | None = None,
    ) -> None:
        self.matchers = matchers
        self._plain_rows = rows
        # Speculative decoding: (matcher, first row, draft) -> rows first.. first+len(draft), the
        # masks after each draft prefix (the matcher walks the draft and is rolled back).
        self._drafted = drafted or []
        #: Every masked row (what apply_token_bitmask_inplace gets as its index).
        self.rows = sorted([*rows, *(first + j for _, first, d in self._drafted for j in range(len(d) + 1))])
        self._num_rows = num_rows
        self._vocab_size = vocab_size
        #: Seconds the fill took (set once it has run), for the grammar metrics.
        self.fill_seconds = 0.0
        self._result: torch.Tensor | None = None
        self._future: Future[torch.Tensor] | None = executor.submit(self._fill) if executor else None

    def _fill(self) -> torch.Tensor:
        from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask
        from agent_infer.grammar.runtime.matcher import fill_next_token_bitmask_batch

        start = time.perf_counter()
        bitmask = allocate_token_bitmask(self._num_rows, self._vocab_size)
        if self.matchers:
            fill_next_token_bitmask_batch(self.matchers, bitmask, self._plain_rows)
        for matcher, first, draft in self._drafted:
            accepted = 0
            try:
                for j in range(len(draft) + 1):
                    matcher.fill_next_token_bitmask(bitmask, first + j)
                    if j < len(draft):
                        if not matcher.accept_token(draft[j]):
                            raise AssertionError(
                                f"grammar rejected draft token {draft[j]} it accepted before"
                            )
                        accepted += 1
            finally:
                if accepted:
                    matcher.rollback(accepted)
        self.fill_seconds = time.perf_counter() - start
        return bitmask

    def result(self) -> torch.Tensor:
        """The filled int32 bitmask ``[num_rows, words]`` (rows without a matcher allow everything).

        Filled once: later calls (the output projection, then masking) return the same tensor.
        """
        if self._result is None:
            self._result = self._future.result() if self._future is not None else self._fill()
        return self._result

    def wait_quietly(self) -> None:
        """Block until a background fill is over, ignoring its outcome (the step is being abandoned)."""
        if self._future is not None:
            # The abandoned step reports its own error; the fill's outcome adds nothing.
            with contextlib.suppress(Exception):
                self._future.result()


class MaskFiller:
    """Starts bitmask fills for a step's sampling rows; ``overlap`` puts them on a background thread."""

    def __init__(self, vocab_size: int, *, overlap: bool) -> None:
        self.vocab_size = vocab_size
        self.overlap = overlap
        # One thread: fills of consecutive steps never run concurrently (matchers are not shared-safe).
        self._executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="agent-infer-mask") if overlap else None
        )

    def start(
        self, matchers: list[GrammarMatcher | None], drafts: list[tuple[int, ...]] | None = None
    ) -> PendingMasks | None:
        """Begin filling the rows of one step's sampling sequences (None: unconstrained), in order;
        ``drafts[i]`` gives sequence ``i`` one extra row per draft token. None when nothing is constrained."""
        drafts = drafts or [()] * len(matchers)
        plain: list[GrammarMatcher] = []
        rows: list[int] = []
        drafted: list[tuple[GrammarMatcher, int, tuple[int, ...]]] = []
        row = 0
        for matcher, draft in zip(matchers, drafts):
            if matcher is not None:
                if draft:
                    drafted.append((matcher, row, draft))
                else:
                    plain.append(matcher)
                    rows.append(row)
            row += 1 + len(draft)
        if not plain and not drafted:
            return None
        return PendingMasks(plain, rows, row, self.vocab_size, self._executor, drafted)

    def shutdown(self) -> None:
        """Release the background thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=False)
