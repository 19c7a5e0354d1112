"""Budget-aware closing: a constrained request that would run out of tokens ends with a valid document.

With ``SamplingParams.close_on_length`` the engine keeps one invariant for a constrained request:
the tokens that close the document by the grammar's shortest completion (plus EOS) fit into what
is left of ``max_tokens``. After each accepted token it checks the invariant for the new state;
when the token breaks it (it opened more than the budget can close), the token is taken back and
the closing tokens of the previous state, which fit by the invariant, are written instead. The
request then finishes ``stop`` with a document the grammar accepts. Where the invariant cannot
hold from the start (the shortest document is longer than ``max_tokens``), nothing changes and the
request may finish ``length`` as usual.
"""

from __future__ import annotations

from agent_infer.engine.sequence import Sequence


def remaining_tokens(seq: Sequence, max_model_len: int) -> int:
    """Output tokens ``seq`` may still append (max_tokens and the context length both count)."""
    return min(seq.params.max_tokens - seq.num_output_tokens, max_model_len - seq.num_tokens)


def closing_after(seq: Sequence, token: int, max_model_len: int) -> list[int] | None:
    """Tokens to append instead of ``token``, which the matcher just accepted, or None to keep it.

    Call after ``seq.matcher`` accepted ``token`` and before it is appended to ``seq``. When keeping
    the token would leave too few tokens to close the document, the matcher is rolled back by
    that token and the closing tokens of the state before it are returned.
    """
    matcher = seq.matcher
    if matcher is None or not seq.params.close_on_length or matcher.is_terminated():
        return None
    left = remaining_tokens(seq, max_model_len) - 1  # once the accepted token is appended
    closing = matcher.closing_tokens()
    if closing is not None and len(closing) <= left:
        return None
    matcher.rollback(1)
    closing = matcher.closing_tokens()
    if closing is None or len(closing) > left + 1:
        # The budget was already too small before this token: nothing to guarantee, keep it.
        if not matcher.accept_token(token):
            raise AssertionError(f"matcher refused token {token} it accepted before the rollback")
        return None
    return closing
