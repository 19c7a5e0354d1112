"""Speculative decoding with prompt-lookup drafts, checked by the grammar and verified in one pass.

A draft is a guess of a request's next few tokens: where the newest tokens (an n-gram, n from 4
down to 1) occurred earlier in the prompt or output, the tokens that followed them then are
proposed again (prompt-lookup decoding: outputs copy names, values and keys from their context).
A constrained request's draft is cut at the first token its grammar rejects and after any token
past which the grammar fixes the text (jump-forward appends those), so every drafted token is one
the mask would allow. Where jump-forward leaves the end of a forced text to the model, that text's
tokens are the draft instead (:mod:`agent_infer.engine.boundary_drafts`).

The next step feeds the request's pending tokens plus its draft; the model returns logits for
the last pending token and for each draft token, each masked by the grammar state at its
position. Verification keeps the longest accepted draft prefix plus one token from the first row
that disagrees (or a bonus token when all agree, unless forced tokens follow the whole draft).
Each row's token is chosen exactly as plain decoding would choose it (the arg-max, or an
inverse-CDF draw of one number from the request's generator), and a draft token is accepted when
it equals that choice. So greedy and seeded requests decode the same tokens with or without
drafts, whatever the batch (bit for bit on the native CPU path, where each row of a short chunk
attends as if decoded alone; elsewhere up to the rounding of a multi-row pass); for a sampled request
a draft token is accepted with exactly its probability under the row, as in speculative sampling
with a deterministic draft.

Per-request state (the draft, the n-gram index, the draft-length schedule and the acceptance
average that decides whether a draft pays off in a batch) lives in
:class:`~agent_infer.engine.spec_state.SpecState` on ``Sequence.spec``.

Requests asking for logprobs, penalties or ``close_on_length`` never draft: their per-token
bookkeeping assumes one sampled token per step. DRY alone is the exception: it depends only on
the tokens before a row, so the engine applies it to each draft row as if the draft tokens before
it were accepted (``penalties.apply_dry_to_draft_rows``), and verification chooses what plain
decoding would.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from agent_infer.engine.boundary_drafts import SplitMemory, boundary_tokens
from agent_infer.engine.closing import remaining_tokens
from agent_infer.engine.sampler import sample_row
from agent_infer.engine.sequence import Sequence
from agent_infer.engine.spec_state import NgramIndex
from agent_infer.sampling_params import SamplingParams


def can_draft(params: SamplingParams) -> bool:
    """Whether a request with ``params`` may use drafts (see the module docstring)."""
    return (
        params.logprobs is None and (not params.penalized or params.only_dry) and not params.close_on_length
    )


class Speculator:
    """Proposes drafts for running sequences and verifies them against the model's rows."""

    def __init__(
        self, max_tokens: int, max_model_len: int, jump_forward: bool = True, boundary: bool = False
    ) -> None:
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len
        self.jump_forward = jump_forward
        self.boundary = boundary
        self.splits = SplitMemory()

    def propose(self, seq: Sequence) -> None:
        """Set ``seq.spec.draft`` for the next step (empty when nothing is worth drafting or the
        request may not draft)."""
        spec = seq.spec
        spec.draft = []
        spec.forced_after = False
        if not can_draft(seq.params):
            return
        if spec.index is None:
            spec.index = NgramIndex()
            spec.draft_len = max(1, self.max_tokens)
        # Room for the draft and the token sampled after it, within max_tokens and the context.
        room = remaining_tokens(seq, self.max_model_len) - 1
        if room <= 0:
            return
        draft = []
        if self.boundary and seq.matcher is not None:
            draft = boundary_tokens(seq.matcher, seq.token_ids, self.splits)[:room]
        if not draft and self.max_tokens:
            draft = spec.index.lookup(seq.token_ids, min(spec.draft_len, room))
        if draft and seq.matcher is not None:
            draft, spec.forced_after = _grammar_prefix(seq, draft, self.jump_forward)
        spec.draft = draft

    def verify(self, seq: Sequence, draft: Seq[int], rows: torch.Tensor) -> tuple[list[int], int]:
        """Tokens ``seq`` gains from masked logits ``rows`` ``[1 + len(draft), vocab]`` and how many
        of them are draft tokens: the accepted prefix of ``draft``, then one token of the model's
        own, except after a whole draft that jump-forward continues (plain decoding would append
        forced tokens there, not sample). Updates the draft-length schedule."""
        bonus = not seq.spec.forced_after
        tokens, n = verify_rows(rows, draft, seq.params, seq.generator, bonus=bonus)
        seq.spec.record(len(draft), n, self.max_tokens)
        return tokens, n


def _grammar_prefix(seq: Sequence, draft: list[int], jump_forward: bool) -> tuple[list[int], bool]:
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


def verify_rows(
    rows: torch.Tensor,
    draft: Seq[int],
    params: SamplingParams,
    generator: torch.Generator | None,
    bonus: bool = True,
) -> tuple[list[int], int]:
    """Choose each row's token as plain decoding would (arg-max, or one draw from ``generator``),
    stopping at the first that differs from the draft's; after a whole draft, choose the next row's
    only when ``bonus``. Returns the tokens and how many of them are accepted draft tokens."""
    best: list[int] = rows.argmax(dim=-1).tolist() if params.greedy else []
    tokens: list[int] = []
    accepted = 0
    for j in range(len(draft) + 1):
        if j == len(draft) and not bonus:
            break
        token = best[j] if params.greedy else sample_row(rows[j], params, generator)
        tokens.append(token)
        if j == len(draft) or token != draft[j]:
            break
        accepted += 1
    return tokens, accepted
