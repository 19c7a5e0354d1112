"""Grammar-forced drafts and the grammar's cut of every draft.

The forced source drafts the text the grammar fixes but jump-forward leaves to the model (its
boundary could still move; :mod:`agent_infer.engine.boundary_drafts` picks the split): certain,
so it is preferred over every guessed source. :func:`grammar_prefix` cuts any source's draft to
what the grammar accepts, and after a token past which the grammar fixes the text (jump-forward
appends that itself).
"""

from __future__ import annotations

from agent_infer.engine.boundary_drafts import SplitMemory, boundary_tokens
from agent_infer.engine.drafts.base import FORCED, Draft
from agent_infer.engine.sequence import Sequence


def forced_draft(seq: Sequence, memory: SplitMemory, room: int) -> Draft | None:
    """The boundary text's tokens as a draft of at most ``room`` tokens, or None."""
    if seq.matcher is None:
        return None
    tokens = boundary_tokens(seq.matcher, seq.token_ids, memory)[:room]
    return Draft(FORCED, tokens, [1.0] * len(tokens)) if tokens else None


def grammar_prefix(seq: Sequence, draft: list[int], jump_forward: bool) -> tuple[list[int], bool]:
    """The longest prefix of ``draft`` the grammar accepts, cut after a token that ends the grammar
    or (with ``jump_forward``) that forced tokens follow, since the engine appends those itself;
    True as the second value in that last case. The matcher is left unchanged."""
    matcher = seq.matcher
    assert matcher is not None
    kept: list[int] = []
    forced_after = False
    for token in draft:
        if matcher.is_terminated() or not matcher.accept_token(token):
            break
        kept.append(token)
        if matcher.is_terminated():
            break
        # forced_bytes() is cheap; forced_tokens() (canonical tokenization, probes) only if needed.
        if jump_forward and matcher.find_forced_bytes()[0] and matcher.forced_tokens():
            forced_after = True
            break
    if kept:
        matcher.rollback(len(kept))
    return kept, forced_after
