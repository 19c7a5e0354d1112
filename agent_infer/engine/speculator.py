"""Speculative decoding with prompt-lookup drafts, checked by the grammar and verified in one pass.

A draft is a guess of a request's next few tokens: where the newest tokens (an n-gram, n from 4
down to 1) occurred earlier in the prompt or output, the tokens that followed them then are
proposed again (prompt-lookup decoding: outputs copy names, values and keys from their context).
A constrained request's draft is cut at the first token its grammar rejects and after any token
past which the grammar fixes the text (jump-forward appends those), so every drafted token is one
the mask would allow.

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

The draft length follows a confidence schedule per request: it starts at
``EngineConfig.speculative_tokens``, grows by one after a fully accepted draft and shrinks to one
more than the accepted prefix after a rejection. Whether a draft is fed at all depends on the
batch: a draft token costs one more row in the forward pass, while an accepted one saves its
request a step, whose fixed cost is shared by the whole batch. With a step of ``B`` rows costing
``a + b·B`` (on CPU, SmolLM2-135M: a ≈ 14 ms, b ≈ 2.4 ms), drafting pays off when a request's
acceptance rate exceeds ``B / (B + a/b)``: 14% alone, 57% among eight. Each request keeps a moving
average of its acceptance rate; the scheduler drops drafts below the threshold for the current
batch (and nudges the average up, so a request that stopped drafting is tried again later).

Boundary drafts (``EngineConfig.boundary_drafts``, on with forced tokens even when
``speculative_tokens`` is 0): jump-forward leaves the last tokens of the forced text to the model
when their boundary could still move (``":`` may merge into ``":"``); tokens spelling that text are
drafted instead of an n-gram guess, since the text is certain and only the split is not: the
model's own latest split of it (this request's tokens, else :class:`SplitMemory` across requests),
else the canonical one.

Requests asking for logprobs, penalties or ``close_on_length`` never draft: their per-token
bookkeeping assumes one sampled token per step. DRY alone is the exception: it depends only on
the tokens before a row, so the engine applies it to each draft row as if the draft tokens before
it were accepted (``penalties.apply_dry_to_draft_rows``), and verification chooses what plain
decoding would.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container
from collections.abc import Sequence as Seq

import torch

from agent_infer.engine.closing import remaining_tokens
from agent_infer.engine.sampler import sample_row
from agent_infer.engine.sequence import Sequence
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.runtime.matcher import GrammarMatcher
from agent_infer.sampling_params import SamplingParams

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


def draft_pays_off(seq: Sequence, batch_size: int) -> bool:
    """Whether ``seq``'s acceptance average clears the break-even rate for ``batch_size`` rows;
    when it does not, the average is nudged up so the request is tried again later."""
    if seq.draft_acceptance >= batch_size / (batch_size + STEP_COST_IN_ROWS):
        return True
    seq.draft_acceptance = min(1.0, seq.draft_acceptance + SKIP_RECOVERY)
    return False


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
        """Set ``seq.draft_ids`` for the next step (empty when nothing is worth drafting)."""
        seq.draft_ids = []
        seq.draft_then_forced = False
        if seq.spec_index is None:
            seq.spec_index = NgramIndex()
            seq.draft_len = max(1, self.max_tokens)
            seq.draft_acceptance = INITIAL_ACCEPTANCE
        # Room for the draft and the token sampled after it, within max_tokens and the context.
        room = remaining_tokens(seq, self.max_model_len) - 1
        if room <= 0:
            return
        draft = []
        if self.boundary and seq.matcher is not None:
            draft = boundary_tokens(seq.matcher, seq.token_ids, self.splits)[:room]
        if not draft and self.max_tokens:
            draft = seq.spec_index.lookup(seq.token_ids, min(seq.draft_len, room))
        if draft and seq.matcher is not None:
            draft, seq.draft_then_forced = _grammar_prefix(seq, draft, self.jump_forward)
        seq.draft_ids = draft

    def verify(self, seq: Sequence, draft: Seq[int], rows: torch.Tensor) -> tuple[list[int], int]:
        """Tokens ``seq`` gains from masked logits ``rows`` ``[1 + len(draft), vocab]`` and how many
        of them are draft tokens: the accepted prefix of ``draft``, then one token of the model's
        own, except after a whole draft that jump-forward continues (plain decoding would append
        forced tokens there, not sample). Updates the draft-length schedule."""
        tokens, n = verify_rows(rows, draft, seq.params, seq.generator, bonus=not seq.draft_then_forced)
        seq.num_draft_tokens += len(draft)
        seq.num_accepted_draft_tokens += n
        if draft:
            full = n == len(draft)
            seq.draft_len = min(self.max_tokens, seq.draft_len + 1) if full else max(1, n + 1)
            rate = n / len(draft)
            seq.draft_acceptance += ACCEPTANCE_EMA * (rate - seq.draft_acceptance)
        return tokens, n


class SplitMemory:
    """How the model last split each boundary text, across requests (bounded, least recent out).

    Keyed by the text's bytes; token ids belong to the engine's one model and tokenizer."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._splits: OrderedDict[bytes, list[int]] = OrderedDict()
        self._prefix_ids: dict[bytes, set[int]] = {}
        self._info: TokenizerInfo | None = None

    def prefix_tokens(self, text: bytes, info: TokenizerInfo) -> set[int]:
        """Ids of the tokens that spell a non-empty prefix of ``text`` (each prefix's canonical
        single token; cached per text). A token with the same bytes under another id is left out,
        which only makes :func:`history_split` skip a position it could have used."""
        if self._info is not info:  # token ids belong to one tokenizer
            self._prefix_ids.clear()
            self._info = info
        found = self._prefix_ids.get(text)
        if found is None:
            found = set()
            for j in range(1, len(text) + 1):
                try:
                    ids = info.encode(text[:j].decode("utf-8"))
                except UnicodeDecodeError:
                    continue  # a prefix ending inside a character has no token of its own here
                if len(ids) == 1 and info.token_bytes(ids[0]) == text[:j]:
                    found.add(ids[0])
            if len(self._prefix_ids) >= self.capacity:
                self._prefix_ids.clear()
            self._prefix_ids[text] = found
        return found

    def get(self, text: bytes) -> list[int] | None:
        """The remembered split of ``text``, if any."""
        split = self._splits.get(text)
        if split is not None:
            self._splits.move_to_end(text)
        return split

    def put(self, text: bytes, split: list[int]) -> None:
        """Remember ``split`` as the model's latest split of ``text``."""
        self._splits[text] = split
        self._splits.move_to_end(text)
        if len(self._splits) > self.capacity:
            self._splits.popitem(last=False)


def boundary_tokens(
    matcher: GrammarMatcher, history: Seq[int] = (), memory: SplitMemory | None = None
) -> list[int]:
    """Tokens spelling the text the grammar fixes next but jump-forward left unsampled.

    Jump-forward stops before a forced token whose boundary could still move (``":`` may become
    ``":"`` once the value starts), so the model samples there. The text itself is certain, so its
    tokens make a draft that costs one row each and is accepted whenever the model's own split
    agrees. A model tends to split a text as it did before (in compact JSON SmolLM2 writes ``":``
    then ``"``, not the canonical ``":"``), so the draft is the latest split of the same text in
    ``history`` (the request's prompt and output), else the one ``memory`` kept from an earlier
    request, else the canonical tokens.
    """
    text, canonical, _ = matcher.forced_text_tokens()
    if not text:
        return canonical
    info = matcher.compiled_grammar.tokenizer_info
    firsts = memory.prefix_tokens(text, info) if memory is not None else None
    split = history_split(text, history, info.token_bytes, firsts)
    if memory is not None:
        if split is not None:
            memory.put(text, split)
        else:
            split = memory.get(text)
    return canonical if split is None else split


#: How many of the newest history tokens :func:`history_split` looks through.
HISTORY_SPLIT_WINDOW = 1024


def history_split(
    text: bytes,
    history: Seq[int],
    token_bytes: Callable[[int], bytes],
    first_tokens: Container[int] | None = None,
) -> list[int] | None:
    """The tokens of the latest run in ``history`` that starts ``text`` at a token boundary and
    either spells all of it or stops where the next token runs past its end (the model merged the
    text's end into what followed, so only the run is known); None when ``text`` never occurs so.

    ``first_tokens`` (optional) holds every token whose bytes are a prefix of ``text``: positions
    holding another token are skipped without decoding it."""
    n = len(history)
    for start in range(n - 1, max(-1, n - 1 - HISTORY_SPLIT_WINDOW), -1):
        if first_tokens is not None and history[start] not in first_tokens:
            continue
        first = token_bytes(history[start])
        if not first or not text.startswith(first):
            continue
        pos, end = len(first), start + 1
        while pos < len(text) and end < n:
            piece = token_bytes(history[end])
            if not piece:
                break
            if text.startswith(piece, pos):
                pos += len(piece)
                end += 1
                continue
            if piece.startswith(text[pos:]):
                return list(history[start:end])  # the model merged the rest into the next token
            break
        if pos == len(text):
            return list(history[start:end])
    return None


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
