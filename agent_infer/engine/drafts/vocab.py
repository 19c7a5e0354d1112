"""The draft vocabulary: the token ids an MTP draft head chooses from.

A draft only proposes; verification scores every draft token with the full model, so a draft head
may choose from a subset of the vocabulary (FR-Spec's frequency-ranked draft vocabulary, EAGLE-3's
draft vocabulary, SGLang's ``--speculative-token-map``). Its output projection is then a gathered
slice of the full head, ``K`` rows instead of the vocabulary's: on a small model with a large
vocabulary (a 4-layer DeepSeek with its 129,280 ids) the full projection is most of a draft step's
cost. A token outside the subset is never proposed, which costs acceptance only where the target
model picks it.

The ``K`` ids are the highest ranked by, first found:

1. ``draft_vocab.json`` beside the checkpoint: ``{"token_ids": [...]}``, most frequent first
   (``scripts/draft_vocab.py`` counts them in text; other keys are read past). A file that is not
   such a JSON object, or lists an id outside the vocabulary or twice, raises
   :class:`ModelLoadError` naming it.
2. The tokenizer's BPE merge order: tokens no merge produces (bytes) first, then by the rank of
   the merge that produces them (BPE learns merges in order of pair frequency in its corpus).
3. Token id order (tokenizers without BPE merges).

A file listing fewer than ``K`` ids is completed from the merge order. The end-of-sequence ids are
always in. ``K`` at or above the vocabulary size (or 0) means the whole vocabulary: no slice.

Grammar masks are bitmasks over the full vocabulary; :meth:`DraftVocab.allowed` reads the bits of
the subset's ids, so a constrained draft position proposes the best token the grammar allows
within the subset, and stops when it allows none there.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from agent_infer.errors import ModelLoadError
from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask
from agent_infer.model.tokenizer import Tokenizer

if TYPE_CHECKING:
    from agent_infer.grammar.runtime.matcher import GrammarMatcher

#: The ranking file beside a checkpoint, and its list of ids (most frequent first).
RANKING_FILE = "draft_vocab.json"
RANKING_KEY = "token_ids"


@dataclass(frozen=True)
class DraftVocab:
    """The draft head's ids (``ids`` None: the whole vocabulary) and where their ranking came from."""

    vocab_size: int
    ids: torch.Tensor | None
    source: str

    @property
    def size(self) -> int:
        """How many ids a draft chooses from."""
        return self.vocab_size if self.ids is None else int(self.ids.numel())

    def to(self, device: torch.device) -> DraftVocab:
        """The same vocabulary with its ids on ``device``."""
        ids = None if self.ids is None else self.ids.to(device)
        return DraftVocab(self.vocab_size, ids, self.source)

    def head(self, weight: torch.Tensor) -> torch.Tensor:
        """The rows of a full output projection ``[vocab, hidden]`` for the draft's ids (a copy), or
        ``weight`` itself for the whole vocabulary."""
        if self.ids is None:
            return weight
        return weight.index_select(0, self.ids.to(weight.device)).contiguous()

    def token(self, index: int) -> int:
        """The token id of position ``index`` of a draft head's output."""
        return index if self.ids is None else int(self.ids[index])

    def propose(self, logits: torch.Tensor, matcher: GrammarMatcher | None) -> tuple[int, float] | None:
        """The arg-max token of a draft head's logits ``[size]`` among the ids ``matcher``'s grammar
        allows next, and its probability under the softmax over them; None when the grammar has
        ended or allows none of the draft's ids."""
        if matcher is not None:
            if matcher.is_terminated():
                return None
            mask = allocate_token_bitmask(1, self.vocab_size)
            matcher.fill_next_token_bitmask(mask, 0)
            allowed = self.allowed(mask.to(logits.device))
            if not bool(allowed.any()):
                return None
            logits = logits.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(logits.float(), dim=-1)
        best = int(probs.argmax())
        return self.token(best), float(probs[best])

    def allowed(self, bitmask: torch.Tensor) -> torch.Tensor:
        """Bool ``[size]``: which of the draft's ids a one-row int32 grammar bitmask allows."""
        words = bitmask.reshape(-1).to(torch.int64)
        ids = self.ids if self.ids is not None else torch.arange(self.vocab_size, device=words.device)
        ids = ids.to(words.device)
        inside = ids < 32 * int(words.numel())
        word = words.index_select(0, torch.where(inside, ids // 32, 0))
        return ((word >> (ids % 32)) & 1).bool() & inside


def build_draft_vocab(
    size: int, vocab_size: int, folder: Path | None, tokenizer: Tokenizer | None, always: Iterable[int]
) -> DraftVocab:
    """The ``size`` best-ranked ids of a ``vocab_size``-id model (see the module docstring); ids in
    ``always`` (the end-of-sequence ids) are in whatever their rank. ``size`` 0 or at least
    ``vocab_size``: the whole vocabulary."""
    if size <= 0 or size >= vocab_size:
        return DraftVocab(vocab_size, None, "full")
    ranked: list[int] = []
    source = "merges"
    path = folder / RANKING_FILE if folder is not None and folder.is_dir() else None
    if path is not None and path.is_file():
        ranked = read_ranking(path, vocab_size)
        source = "file"
    if len(ranked) < size:
        merges = merge_order(tokenizer, vocab_size)
        if merges is None:
            merges = list(range(vocab_size))
            source = source if ranked else "ids"
        ranked = _merged(ranked, merges)
    chosen: dict[int, None] = dict.fromkeys(t for t in always if 0 <= t < vocab_size)
    for token in ranked:
        if len(chosen) >= size:
            break
        chosen.setdefault(token, None)
    ids = torch.tensor(sorted(chosen), dtype=torch.int64)
    return DraftVocab(vocab_size, ids, source)


def read_ranking(path: Path, vocab_size: int) -> list[int]:
    """The ids of a ranking file, most frequent first; :class:`ModelLoadError` naming the file when
    it is not a JSON object with a list of ids in ``[0, vocab_size)``, or repeats one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not a readable JSON file ({exc})") from exc
    ids = data.get(RANKING_KEY) if isinstance(data, dict) else None
    if not isinstance(ids, list):
        raise ModelLoadError(
            f"{path}: expected an object with a list {RANKING_KEY!r} (the draft vocabulary's ranking)"
        )
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise ModelLoadError(
                f"{path}: {RANKING_KEY}[{i}] = {token!r} is not a token id of the model's vocabulary [0, {vocab_size})"
            )
    if len(set(ids)) != len(ids):
        raise ModelLoadError(f"{path}: {RANKING_KEY!r} lists an id more than once")
    return list(ids)


def merge_order(tokenizer: Tokenizer | None, vocab_size: int) -> list[int] | None:
    """The ids of a BPE tokenizer's vocabulary, tokens no merge produces first (by id), then by the
    rank of the merge producing them; None when the tokenizer has no BPE merges."""
    if tokenizer is None:
        return None
    try:
        spec = json.loads(tokenizer.hf_tokenizer.to_str())
    except (AttributeError, ValueError):
        return None
    model = spec.get("model") or {}
    vocab, merges = model.get("vocab"), model.get("merges")
    if model.get("type") != "BPE" or not isinstance(vocab, dict) or not merges:
        return None
    rank: dict[str, int] = {}
    for i, merge in enumerate(merges):
        pair = merge if isinstance(merge, list) else str(merge).split(" ", 1)
        if len(pair) == 2:
            rank.setdefault(pair[0] + pair[1], i)
    special = {t.get("id") for t in spec.get("added_tokens", ()) if t.get("special")}
    entries = [(rank.get(tok, -1), i) for tok, i in vocab.items() if 0 <= i < vocab_size and i not in special]
    return [i for _, i in sorted(entries)]


def _merged(first: list[int], then: list[int]) -> list[int]:
    seen = dict.fromkeys(first)
    for token in then:
        seen.setdefault(token, None)
    return list(seen)
