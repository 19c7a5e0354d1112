"""Prompt-lookup drafts: the tokens that followed the newest n-gram's latest earlier occurrence.

Outputs copy names, values and keys from their context, so where the newest tokens (an n-gram, n
from 4 down to 1) occurred earlier in the prompt or output, the tokens that followed them then are
proposed again. The lookup has no probabilities of its own; a request's recent acceptance of its
n-gram drafts stands in for them when the speculator compares sources.
"""

from __future__ import annotations

#: Longest and shortest n-gram looked up; longer matches are tried first.
MAX_NGRAM = 4
MIN_NGRAM = 1


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
