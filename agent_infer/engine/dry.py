"""The DRY ("Don't Repeat Yourself") penalty: a lower logit for the token that would extend a repeat.

Semantics follow llama.cpp's ``dry_*`` sampler. At each step, for every earlier position ``j`` of
the window whose tokens end with the same ``n`` tokens as the window does (``n`` capped at the
tokens since the last sequence breaker at the end), the token that followed ``j`` would extend a
repeat of length ``n``; each such token loses ``multiplier * base ** (n - allowed_length)`` (the
longest repeat it extends counts, and none below ``allowed_length``). The exponent is clamped so
that the penalty stays finite in float32. A token whose text contains a breaker is never penalized.

Two choices differ from llama.cpp, both because of what structured output does:

* The window is the request's *output* (its last ``dry_penalty_last_n`` tokens, -1 for all), not
  the prompt: extraction copies names, e-mails and numbers from the prompt, and a penalty on
  copying would lower accuracy exactly where a loop is not the problem.
* ``dry_skip_whitespace`` makes whitespace-only tokens transparent (dropped from the window before
  matching, never penalized). A recursive JSON value that nests the same object forever changes
  its indentation at every level, which hides the repeat from token-exact matching.

Everything is computed from one row's own tokens, so a request's output does not depend on what
else is in the batch. Cost is linear in the window (a Z-function over the reversed window).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from agent_infer.sampling_params import SamplingParams

# The largest float32 exponent of e, as llama.cpp clamps base ** exponent with it.
_FLOAT32_MAX_LOG = 88.7228391


class TokenTexts:
    """The text of single tokens, decoded on first use: only tokens that appear in some request's
    DRY window are ever decoded, so no pass over the vocabulary is needed."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._texts: dict[int, str] = {}

    def text(self, token: int) -> str:
        """The decoded text of ``token`` alone."""
        text = self._texts.get(token)
        if text is None:
            text = self._decode([token])
            self._texts[token] = text
        return text


def z_function(s: Sequence[int]) -> list[int]:
    """``z[i]``: the length of the longest common prefix of ``s`` and ``s[i:]`` (``z[0] = len(s)``)."""
    n = len(s)
    z = [0] * n
    if n:
        z[0] = n
    left = right = 0
    for i in range(1, n):
        k = min(right - i, z[i - left]) if i < right else 0
        while i + k < n and s[k] == s[i + k]:
            k += 1
        z[i] = k
        if i + k > right:
            left, right = i, i + k
    return z


def repeat_lengths(tokens: Sequence[int], breaker: Sequence[bool], allowed_length: int) -> dict[int, int]:
    """Per candidate token, the longest repeat (>= ``allowed_length``) that it would extend.

    ``breaker[k]`` tells whether ``tokens[k]`` is a sequence breaker; a repeat is at most as long
    as the run of non-breakers at the end of ``tokens``.
    """
    n = len(tokens)
    limit = 0
    while limit < n and not breaker[n - 1 - limit]:
        limit += 1
    if limit < allowed_length:
        return {}
    rev = tokens[::-1]
    z = z_function(rev)
    best: dict[int, int] = {}
    # rev[i] is tokens[n-1-i]; the token that followed it is rev[i-1].
    for i in range(1, n):
        length = min(z[i], limit)
        if length >= allowed_length:
            candidate = rev[i - 1]
            if best.get(candidate, 0) < length:
                best[candidate] = length
    return best


def dry_penalties(output: Sequence[int], params: SamplingParams, texts: TokenTexts) -> dict[int, float]:
    """``{token: amount}`` to subtract from the logits of the row whose output tokens are ``output``."""
    if not params.dry:
        return {}
    window = list(output if params.dry_penalty_last_n < 0 else output[-params.dry_penalty_last_n :])
    if params.dry_skip_whitespace:
        window = [t for t in window if texts.text(t).strip()]
    if len(window) < 2:
        return {}
    breakers = params.dry_sequence_breakers or ()

    def is_breaker(token: int) -> bool:
        text = texts.text(token)
        return any(b in text for b in breakers)

    flags = [is_breaker(t) for t in window] if breakers else [False] * len(window)
    lengths = repeat_lengths(window, flags, params.dry_allowed_length)
    if not lengths:
        return {}
    max_exponent = int(_FLOAT32_MAX_LOG / math.log(params.dry_base)) if params.dry_base > 1.000001 else 0
    out: dict[int, float] = {}
    for token, length in lengths.items():
        if breakers and is_breaker(token):
            continue
        exponent = length - params.dry_allowed_length
        if max_exponent > 0:
            exponent = min(exponent, max_exponent)
        try:
            out[token] = params.dry_multiplier * params.dry_base**exponent
        except OverflowError:  # a huge base: llama.cpp's float pow gives inf, so the token is banned
            out[token] = math.inf
    return out
