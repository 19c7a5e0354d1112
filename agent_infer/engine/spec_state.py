"""What speculative decoding keeps per request (``Sequence.spec``): its draft, n-gram index and confidence.

The draft length follows a confidence schedule per request: it starts at
``EngineConfig.speculative_tokens``, grows by one after a fully accepted draft and shrinks to one
more than the accepted prefix after a rejection. Whether a draft is fed at all depends on the
batch: a draft token costs one more row in the forward pass, while an accepted one saves its
request a step, whose fixed cost is shared by the whole batch. With a step of ``B`` rows costing
``a + b·B`` (on CPU, SmolLM2-135M: a ≈ 14 ms, b ≈ 2.4 ms), drafting pays off when a request's
acceptance rate exceeds ``B / (B + a/b)``: 14% alone, 57% among eight. Each request keeps a moving
average of its acceptance rate; the scheduler drops drafts below the threshold for the current
batch and nudges the average up (:meth:`SpecState.skip`), so a request that stopped drafting is
tried again later.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Longest and shortest n-gram looked up; longer matches are tried first.
MAX_NGRAM = 4
MIN_NGRAM = 1
#: Fixed cost of a forward step over the cost of one more row (``a/b`` in the module docstring).
#: Measured on CPU; on accelerators extra rows are relatively cheaper, so this is conservative.
STEP_COST_IN_ROWS = 6.0
#: Weight of the newest draft in a request's acceptance average, and the average's start value.
ACCEPTANCE_EMA = 0.3
INITIAL_ACCEPTANCE = 0.6
#: How far a skipped draft moves the average back up (retry after a few skipped steps).
SKIP_RECOVERY = 0.05


class NgramIndex:
    """For each n-gram of a token list, where it last ended; grows as tokens are appended."""

    __slots__ = ("indexed", "tables")

    def __init__(self) -> None:
        self.tables: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_NGRAM + 1)]
        self.indexed = 0  # n-grams ending at positions <= indexed are in the tables

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix n-gram."""
        length = len(tokens)
        # Index every n-gram ending before the last position: the suffix itself must not match.
        for end in range(max(self.indexed, 1), length):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                self.tables[n][tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, length - 1)
        for n in range(min(MAX_NGRAM, length - 1), MIN_NGRAM - 1, -1):
            found = self.tables[n].get(tuple(tokens[length - n :]))
            if found is not None:
                return tokens[found : found + k]
        return []


@dataclass(slots=True)
class SpecState:
    """One request's speculative decoding state.

    ``draft`` holds the tokens guessed for the next step: fed after the pending ones and verified
    there, not part of ``Sequence.token_ids`` until accepted. ``index`` is None until the request's
    first proposal (requests that never draft build no index).
    """

    draft: list[int] = field(default_factory=list)
    #: The grammar forces tokens right after the whole draft (no bonus token is sampled there).
    forced_after: bool = False
    #: The current draft length (the confidence schedule).
    draft_len: int = 0
    #: Moving average of the request's acceptance rate.
    acceptance: float = INITIAL_ACCEPTANCE
    index: NgramIndex | None = None
    #: Draft tokens verified so far, and how many of them were accepted (reported in metrics).
    num_drafted: int = 0
    num_accepted: int = 0

    def record(self, drafted: int, accepted: int, max_len: int) -> None:
        """Account for a verified draft of ``drafted`` tokens of which ``accepted`` were taken: the
        counters, the draft length (capped at ``max_len``) and the acceptance average."""
        self.num_drafted += drafted
        self.num_accepted += accepted
        if drafted:
            full = accepted == drafted
            self.draft_len = min(max_len, self.draft_len + 1) if full else max(1, accepted + 1)
            self.acceptance += ACCEPTANCE_EMA * (accepted / drafted - self.acceptance)

    def skip(self) -> None:
        """Drop the draft because it does not pay off in this batch; the average moves up so that
        drafting is tried again after a few skipped steps."""
        self.draft = []
        self.acceptance = min(1.0, self.acceptance + SKIP_RECOVERY)


def draft_pays_off(spec: SpecState, batch_size: int) -> bool:
    """Whether ``spec``'s acceptance average clears the break-even rate for ``batch_size`` rows."""
    return spec.acceptance >= batch_size / (batch_size + STEP_COST_IN_ROWS)
