"""Loop detection inside one JSON value: a bias toward closing the value that repeats itself.

DRY lowers the token that would extend an exact repeat, so a model in a loop picks a variation
(``ngozi-ngoza-ngozu-...``, a tree whose every level renames its node, a list of dates counting
down) and the value still never ends. This adjustment looks at the value instead of the next
token: the output is scanned as JSON (strings with their escapes, arrays, objects), and for the
innermost open value it counts the token bigrams (whitespace-only tokens skipped) that already
occurred earlier in that value. Past ``allowed`` repeats, every token that closes the value (a
string's ``"``, an array's ``]``, an object's ``}``, after optional whitespace) gains
``multiplier`` per further repeat. For a string the string's own repeats count; for an array or
an object the most repetitive open container counts, since a nested structure (a recursive tree)
repeats across its levels, and the only way out of it starts by closing the innermost one.

The grammar's mask still applies (a masked token stays masked), so the bias only ever chooses
between continuations the constraint allows: a value that may not close yet (``minItems``, a
pattern) is not cut. Everything is computed from the row's own tokens: deterministic and
independent of the batch. Cost is linear in the output per penalized row and step.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from agent_infer.engine.dry import TokenTexts

_CLOSERS = {'"': '"', "[": "]", "{": "}"}


def scan(texts: Sequence[str]) -> tuple[list[tuple[str, int]], list[bool]]:
    """The JSON values open at the end of the concatenated ``texts`` (outermost first, each as its
    opening character and the index of the text where it opened), and per text whether it holds
    content: characters of a string value (not a key) or of a number."""
    stack: list[tuple[str, int]] = []
    content = [False] * len(texts)
    in_string = escaped = is_key = False
    expect_key = False  # inside an object, after "{" or ","
    for k, text in enumerate(texts):
        for ch in text:
            if in_string:
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
                    stack.pop()
                    continue
                if not is_key:
                    content[k] = True
            elif ch == '"':
                in_string, is_key = True, expect_key
                stack.append(('"', k))
            elif ch in "[{":
                stack.append((ch, k))
                expect_key = ch == "{"
            elif ch in "]}":
                if stack:
                    stack.pop()
                expect_key = False
            elif ch == ",":
                expect_key = bool(stack) and stack[-1][0] == "{"
            elif ch == ":":
                expect_key = False
            elif ch in "-0123456789.eE+":
                content[k] = True
    return stack, content


def repeated_bigrams(tokens: Sequence[int]) -> int:
    """How many adjacent pairs of ``tokens`` already occurred earlier in ``tokens``."""
    seen: set[tuple[int, int]] = set()
    repeats = 0
    for pair in itertools.pairwise(tokens):
        if pair in seen:
            repeats += 1
        else:
            seen.add(pair)
    return repeats


class ClosingTokens:
    """Per closing character, the ids of the tokens whose text starts with it (after whitespace
    for ``]`` and ``}``); found in one pass over the vocabulary on first use."""

    def __init__(self, vocab_size: int, texts: TokenTexts) -> None:
        self._vocab_size = vocab_size
        self._texts = texts
        self._ids: dict[str, torch.Tensor] = {}

    def ids(self, closer: str) -> torch.Tensor:
        """The token ids that close a value with ``closer``."""
        hit = self._ids.get(closer)
        if hit is None:
            text: Callable[[int], str] = self._texts.text
            if closer == '"':
                found = [t for t in range(self._vocab_size) if text(t).startswith('"')]
            elif closer == '"]':
                found = [
                    t
                    for t in range(self._vocab_size)
                    if text(t).startswith('"') and not text(t)[1:].strip(" \t\r\n]}")
                ]
            else:
                found = [t for t in range(self._vocab_size) if text(t).lstrip().startswith(closer)]
            hit = self._ids[closer] = torch.tensor(found, dtype=torch.long)
        return hit


def value_close_bias(
    output: Sequence[int], multiplier: float, allowed: int, texts: TokenTexts
) -> tuple[str, float] | None:
    """(which tokens to favour, the bias to add to them) for the row whose output tokens are
    ``output``, or None when no open value repeats past ``allowed``.

    The key is a closing character (``"``, ``]``, ``}``: the tokens that start by closing the
    innermost value), or ``'"]'`` (the tokens that close the innermost string and nothing but
    whitespace, ``]`` or ``}`` after it) when the string does not repeat but its container does:
    a list of dates counting down repeats across its items, and ends after an item closes.
    """
    token_texts = [texts.text(t) for t in output]
    stack, content = scan(token_texts)
    if not stack:
        return None
    kind, start = stack[-1]
    containers = [k for c, k in stack if c != '"']
    outer = max(
        (repeated_bigrams([output[i] for i in range(k, len(output)) if content[i]]) for k in containers),
        default=0,
    )
    if kind != '"':
        return (_CLOSERS[kind], multiplier * (outer - allowed)) if outer > allowed else None
    own = repeated_bigrams(
        [t for t, s in zip(output[start + 1 :], token_texts[start + 1 :], strict=True) if s.strip()]
    )
    return ('"', multiplier * (own - allowed)) if own > allowed else None
