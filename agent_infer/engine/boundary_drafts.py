"""Boundary drafts: the tokens of the forced text that jump-forward leaves to the model.

With ``EngineConfig.boundary_drafts`` (on with forced tokens even when ``speculative_tokens`` is 0),
jump-forward leaves the last tokens of the forced text to the model when their boundary could
still move (``":`` may merge into ``":"``); tokens spelling that text are drafted instead of an
n-gram guess, since the text is certain and only the split is not: the model's own latest split
of it (this request's tokens, else :class:`SplitMemory` across requests), else the canonical one.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Container
from collections.abc import Sequence as Seq

from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.runtime.matcher import GrammarMatcher


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
