"""Loop detection inside one JSON value: a bias toward closing the value that repeats itself.

DRY lowers the token that would extend an exact repeat, so a model in a loop picks a variation
(``ngozi-ngoza-ngozu-...``, a tree whose every level renames its node, a list of dates counting
down) and the value still never ends. This adjustment looks at the value instead of the next
token: the output is scanned as JSON (strings with their escapes, arrays, objects), and for the
innermost open value it counts the token bigrams that already occurred earlier in that value: a
string counts its own tokens (whitespace-only ones skipped), an array or object its content tokens
(characters of string values and numbers; keys and punctuation would make every object with a few
members look like a loop). Past ``allowed`` repeats, every token that closes the value (a string's
``"``, an array's ``]``, an object's ``}``, after optional whitespace) gains ``multiplier`` per
further repeat (``penalties.py`` also favours the first token of the grammar's shortest
completion). For a string the string's own repeats count; for an array or an object the most
repetitive open container counts, since a nested structure (a recursive tree) repeats across its
levels, and the only way out of it starts by closing the innermost one.

The grammar's mask still applies (a masked token stays masked), so the bias only ever chooses
between continuations the constraint allows: a value that may not close yet (``minItems``, a
pattern) is not cut. Everything is computed from the row's own tokens: deterministic and
independent of the batch. The scan is incremental (:class:`ValueScanner`, kept on the sequence),
so a request pays once per output token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from agent_infer.engine.dry import TokenTexts

_CLOSERS = {'"': '"', "[": "]", "{": "}"}


class _Frame:
    """One open value: its opening character and the token bigrams counted in it so far."""

    __slots__ = ("kind", "last", "repeats", "seen")

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.seen: set[tuple[int, int]] = set()
        self.last: int | None = None
        self.repeats = 0

    def add(self, token: int) -> None:
        if self.last is not None:
            pair = (self.last, token)
            if pair in self.seen:
                self.repeats += 1
            else:
                self.seen.add(pair)
        self.last = token


class ValueScanner:
    """The output scanned as JSON, token by token, keeping per open value its repeated bigrams.

    A string counts the tokens after the one that opened it (whitespace-only tokens skipped); an
    array or object counts the content tokens from the one that opened it on: tokens holding
    characters of a string value (not a key) or of a number. Feeding is incremental, so a request
    costs time linear in its output over all its steps.
    """

    def __init__(self) -> None:
        self.frames: list[_Frame] = []
        self.fed = 0  # tokens scanned so far
        self._in_string = self._escaped = self._is_key = self._expect_key = False

    def feed(self, token: int, text: str) -> None:
        """Scan one more token."""
        frames = self.frames
        content = False
        string_before = frames[-1] if frames and frames[-1].kind == '"' else None
        for ch in text:
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    frames.pop()
                    continue
                content = content or not self._is_key
            elif ch == '"':
                self._in_string, self._is_key = True, self._expect_key
                frames.append(_Frame('"'))
            elif ch in "[{":
                frames.append(_Frame(ch))
                self._expect_key = ch == "{"
            elif ch in "]}":
                if frames:
                    frames.pop()
                self._expect_key = False
            elif ch == ",":
                self._expect_key = bool(frames) and frames[-1].kind == "{"
            elif ch == ":":
                self._expect_key = False
            elif ch in "-0123456789.eE+":
                content = True
        if content:
            for frame in frames:
                if frame.kind != '"':
                    frame.add(token)
        if frames and frames[-1] is string_before and text.strip():
            frames[-1].add(token)  # a string counts the tokens after the one that opened it
        self.fed += 1


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
    scanner: ValueScanner, output: Sequence[int], multiplier: float, allowed: int, texts: TokenTexts
) -> tuple[str, float] | None:
    """(the closing character whose tokens to favour, the bias to add to them) for the row whose
    output tokens are ``output`` (``scanner`` has scanned a prefix of them and is brought up to
    date), or None when the open value does not repeat past ``allowed``.

    Inside a string its own repeats count; inside an array or object the most repetitive open
    container's (a nested structure repeats across its levels, and the way out of it starts by
    closing the innermost one).
    """
    for token in output[scanner.fed :]:
        scanner.feed(token, texts.text(token))
    frames = scanner.frames
    if not frames:
        return None
    kind = frames[-1].kind
    if kind == '"':
        count = frames[-1].repeats
    else:
        count = max(f.repeats for f in frames if f.kind != '"')
    return (_CLOSERS[kind], multiplier * (count - allowed)) if count > allowed else None
