"""Closing pressure near ``max_tokens``: a growing bias toward the grammar's way out.

A structured output cut at ``max_tokens`` is lost (it does not parse), whatever kept it going: a
loop the repeat detectors missed, a recursive tree that keeps adding siblings, free text before an
optional tool call that rambles on. ``close_on_length`` rescues such an output by writing the
grammar's shortest completion once nothing else fits, which cuts a value wherever it stands. This
bias acts earlier and softly: over the last ``value_close_budget * max_tokens`` tokens of slack
(the tokens left beyond those the shortest completion needs), the first token of that completion
(EOS once the grammar may end, EOS too for a request without a grammar) gains a bias rising
linearly from 0 to ``value_close_budget_bias``. The model then ends at a point where ending is
already likely (after an item, at the end of a sentence) rather than being cut mid-value, and an
output that ends well inside its budget is never touched.

The bias is a function of the output length and the matcher's state only: deterministic and
independent of the batch. The shortest completion is computed only inside twice the window (so a
closing longer than the window starts the ramp late, never early).
"""

from __future__ import annotations

import math
from collections.abc import Collection

from agent_infer.engine.sequence import Sequence


def budget_window(max_tokens: int, fraction: float) -> int:
    """Tokens of slack over which the bias ramps up (at least 1)."""
    return max(1, math.ceil(fraction * max_tokens))


def ramp(slack: int, window: int, bias: float) -> float:
    """The bias with ``slack`` tokens left beyond the closing: 0 from ``window`` up, ``bias`` at 0 and below."""
    if slack >= window:
        return 0.0
    return bias * min(1.0, 1.0 - slack / window)


def way_out(seq: Sequence, eos_token_ids: Collection[int]) -> tuple[int, int] | None:
    """(the first token of the shortest way to end, how many tokens that way takes), or None when
    there is none to favour (a terminated matcher, a completion the vocabulary cannot spell)."""
    matcher = seq.matcher
    if matcher is None:
        eos = min(eos_token_ids, default=None)
        return None if eos is None else (eos, 1)
    if matcher.is_terminated():
        return None
    closing = matcher.closing_tokens()
    if not closing:
        return None
    return closing[0], len(closing)


def budget_close_bias(seq: Sequence, used: int, eos_token_ids: Collection[int]) -> tuple[int, float] | None:
    """(token, bias to add) for ``seq`` after ``used`` output tokens, or None outside the window."""
    p = seq.params
    if p.ignore_eos and seq.matcher is None:
        return None
    window = budget_window(p.max_tokens, p.value_close_budget)
    left = p.max_tokens - used
    if left > 2 * window:
        return None
    found = way_out(seq, eos_token_ids)
    if found is None:
        return None
    token, length = found
    bias = ramp(left - length, window, p.value_close_budget_bias)
    return (token, bias) if bias > 0.0 else None
