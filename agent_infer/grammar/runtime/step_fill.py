"""One engine step's mask fill as a native job: run on a native thread during the forward pass, or here.

The fill of a step's rows (a batch over distinct matchers, then each draft's rows, the matcher
walked along the draft and rolled back) runs in C++ from start to end
(``engine_native/src/grammar/batch/step_fill.cpp``). The filling thread never needs the GIL, so
the thread stepping the model never waits for it to hand the GIL back, and the fill reports which
rows restrict nothing (the caller skips masking those).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from agent_infer.errors import MatcherUsageError, TokenBitmaskError
from agent_infer.grammar.runtime.matcher import GrammarMatcher, pool_settings
from agent_infer.native import load_native

#: A draft chain: the matcher, its first bitmask row, and the draft tokens (one more row each).
Chain = tuple[GrammarMatcher, int, Sequence[int]]


class StepFill:
    """The fill of ``plain[i]`` into row ``rows[i]`` and of each chain's rows, into ``bitmask``; its
    other rows are set to allow every token.

    ``bitmask`` is a C-contiguous int32 CPU tensor torch allocated (``allocate_token_bitmask``).
    ``threads`` caps the batch's threads (0: the whole pool) when some row meets a grammar state for
    the first time; ``cached_threads`` when every row's masks are cached; ``pool_size`` is what
    :func:`~agent_infer.grammar.runtime.matcher.pool_settings` returns (read now when None). The
    matchers are busy
    (:class:`~agent_infer.errors.MatcherBusyError` for other calls) from here until the fill has run.
    Bad rows or widths raise :class:`TokenBitmaskError`, a matcher given twice
    :class:`MatcherUsageError`.
    """

    def __init__(
        self,
        plain: Sequence[GrammarMatcher],
        rows: Sequence[int],
        chains: Sequence[Chain],
        bitmask: torch.Tensor,
        *,
        threads: int = 0,
        cached_threads: int = 0,
        pool_size: int | None = None,
    ) -> None:
        if (
            type(bitmask) is not torch.Tensor
            or bitmask.dtype is not torch.int32
            or not bitmask.is_cpu
            or bitmask.dim() != 2
            or not bitmask.is_contiguous()
            or not bitmask.untyped_storage().resizable()
        ):
            raise TokenBitmaskError(
                "a step's fill writes into a C-contiguous 2-D int32 CPU tensor torch allocated "
                "(allocate_token_bitmask)"
            )
        try:
            handles = [m._m for m in plain if type(m) is GrammarMatcher]
            links = [(m._m, first, list(draft)) for m, first, draft in chains if type(m) is GrammarMatcher]
        except AttributeError:  # a subclass without a native matcher
            handles = links = []
        if len(handles) != len(plain) or len(links) != len(chains):
            for i, m in enumerate([*plain, *(c[0] for c in chains)]):
                if not isinstance(m, GrammarMatcher) or not hasattr(m, "_m"):
                    raise MatcherUsageError(
                        f"matchers[{i}] is a {type(m).__name__}, not a GrammarMatcher", argument="matchers"
                    )
            handles = [m._m for m in plain]
            links = [(m._m, first, list(draft)) for m, first, draft in chains]
        num_rows, words = bitmask.shape
        self.bitmask = bitmask
        self._native = load_native().StepFill(
            handles,
            list(rows),
            links,
            bitmask,
            bitmask.data_ptr(),
            num_rows,
            words,
            threads,
            cached_threads,
            pool_settings() if pool_size is None else pool_size,
        )

    def finish(self) -> list[bool]:
        """Run the fill here unless a :class:`FillThread` has it, else wait for it (the GIL released);
        per row (plain rows, then chain rows): whether it restricts anything. Raises the fill's error."""
        return list(self._native.finish())

    def apply_cpu(self, logits: torch.Tensor) -> None:
        """:meth:`finish`, then ``-inf`` the disallowed tokens of float32 C-contiguous CPU ``logits``
        ``[batch, vocab]`` in place (bitmask row ``r`` onto logits row ``r``), skipping every row that
        allows all tokens."""
        self._native.apply_cpu(logits)

    @property
    def done(self) -> bool:
        """Whether the fill has run (successfully or not)."""
        return bool(self._native.done)

    @property
    def seconds(self) -> float:
        """How long the fill itself ran."""
        return float(self._native.seconds)


class FillThread:
    """A native thread running submitted :class:`StepFill` jobs in order (consecutive steps never overlap)."""

    def __init__(self) -> None:
        self._native: Any = load_native().FillThread()

    def submit(self, fill: StepFill) -> bool:
        """Queue ``fill`` (join it with :meth:`StepFill.finish`); False once stopped (it then runs on
        the thread that finishes it)."""
        return bool(self._native.submit(fill._native))

    def stop(self) -> None:
        """Run what is queued, then end the thread."""
        self._native.stop()
