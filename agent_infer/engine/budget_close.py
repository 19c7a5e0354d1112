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

Inside twice the window, a token that would leave the document unclosable within the budget (the
shortest completion after it is longer than the tokens left) is masked among the
``DOOMED_CANDIDATES`` most likely ones: such a token makes the output end ``length`` whatever
follows, so masking it changes only outputs that would fail. The typical case is a model that
starts another tool call or list item too late to finish it.

Both are functions of the output length and the matcher's state only: deterministic and
independent of the batch. The shortest completion is computed only inside twice the window (so a
closing longer than the window starts the ramp late, never early).
"""

from __future__ import annotations

import math
from collections.abc import Collection

import torch

from agent_infer.engine.sequence import Sequence

#: How many of the most likely tokens are checked for leaving the document unclosable.
DOOMED_CANDIDATES = 4


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


def mask_doomed(row: torch.Tensor, seq: Sequence, used: int, eos_token_ids: Collection[int]) -> None:
    """Set to -inf, among the most likely tokens of ``row``, those after which the grammar's
    shortest completion no longer fits into what is left of ``max_tokens``: inside twice the
    window, while the document still fits, and only when one of those likely tokens fits (EOS
    does)."""
    matcher = seq.matcher
    p = seq.params
    if matcher is None or matcher.is_terminated():
        return
    left = p.max_tokens - used
    if left > 2 * budget_window(p.max_tokens, p.value_close_budget):
        return
    now = matcher.closing_tokens()
    if now is None or len(now) > left:
        return  # nothing to protect: the document no longer fits whatever is chosen
    values, ids = torch.topk(row, min(DOOMED_CANDIDATES, row.shape[0]))
    doomed: list[int] = []
    viable = False
    for value, token in zip(values.tolist(), ids.tolist()):
        if value == -math.inf:
            break
        if token in eos_token_ids or not matcher.accept_token(token):
            viable = viable or token in eos_token_ids
            continue
        try:
            after = None if matcher.is_terminated() else matcher.closing_tokens()
        finally:
            matcher.rollback(1)
        if after is not None and len(after) > left - 1:
            doomed.append(token)
        else:
            viable = True
    # Only where a likely token still fits: masking a few of many doomed tokens would change an
    # output that fails anyway (a hard close is close_on_length's job).
    if viable and doomed:
        row[doomed] = -math.inf
