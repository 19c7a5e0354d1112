"""Reasoning parsers: split a reasoning model's thinking from its answer (``--reasoning-parser``).

``deepseek_r1`` reads DeepSeek's shape, which DeepSeek-R1, V3.1 (thinking mode) and later emit:
``<think>THINKING</think>ANSWER``. As in vLLM's parser of the same name, the output is thinking
from its first character (the chat templates of these models end the prompt with ``<think>``, so
a leading ``<think>`` in the output is optional and dropped) until the first ``</think>``; what
follows is the answer. An output without ``</think>`` is all thinking and has no answer.

The whole-text split and the stream split agree at every split point of the text: the stream
holds back only a tail that may still become ``<think>`` (at the start) or ``</think>``.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent_infer.errors import ConfigError
from agent_infer.grammar.ir import Grammar, lit, seq
from agent_infer.tool_formats.grammar_parts import GrammarBuilder

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

#: The names ``--reasoning-parser`` accepts.
REASONING_PARSERS = ("deepseek_r1",)


@dataclass(frozen=True)
class ReasoningSplit:
    """An output's ``reasoning`` (thinking) and ``content`` (answer); None where there is none."""

    reasoning: str | None
    content: str | None


def check_reasoning_parser(name: str | None) -> None:
    """Raise :class:`ConfigError` unless ``name`` is None or one of :data:`REASONING_PARSERS`."""
    if name is not None and name not in REASONING_PARSERS:
        raise ConfigError(f"reasoning_parser must be one of {list(REASONING_PARSERS)} or None, got {name!r}")


def split_reasoning(text: str) -> ReasoningSplit:
    """The thinking and the answer of a complete output (see the module docstring)."""
    body = text[len(THINK_OPEN) :] if text.startswith(THINK_OPEN) else text
    end = body.find(THINK_CLOSE)
    if end < 0:
        return ReasoningSplit(body or None, None)
    return ReasoningSplit(body[:end] or None, body[end + len(THINK_CLOSE) :] or None)


class ReasoningStream:
    """Incremental :func:`split_reasoning`: ``feed`` returns the new (reasoning, content) text.

    Each feed searches for ``</think>`` only in the text that arrived since the last search (plus
    the tag's length, for a tag split across deltas), so a long thinking costs linear time.
    """

    def __init__(self) -> None:
        self._text = ""
        self._searched = 0  # ``</think>`` does not start before this offset
        self._end: int | None = None  # where ``</think>`` starts, once seen
        self._reasoning_sent = 0  # characters of the thinking already returned
        self._content_sent = 0  # characters of the answer already returned

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """Add ``delta``; with ``final`` the output is complete and nothing is held back."""
        self._text += delta
        text = self._text
        if not final and THINK_OPEN.startswith(text):
            return "", ""  # may still become the optional opening tag
        start = len(THINK_OPEN) if text.startswith(THINK_OPEN) else 0
        if self._end is None:
            found = text.find(THINK_CLOSE, max(start, self._searched))
            self._searched = max(start, len(text) - len(THINK_CLOSE) + 1)
            self._end = found if found >= 0 else None
        if self._end is None:
            stop = len(text) if final else len(text) - _partial_suffix(text, THINK_CLOSE, start)
            reasoning_end, content_start = stop, len(text)
        else:
            reasoning_end, content_start = self._end, self._end + len(THINK_CLOSE)
        new_reasoning = text[start + self._reasoning_sent : reasoning_end]
        new_content = text[content_start + self._content_sent :]
        self._reasoning_sent += len(new_reasoning)
        self._content_sent += len(new_content)
        return new_reasoning, new_content

    def finish(self) -> tuple[str, str]:
        """The output is complete: what was held back in case it began a tag."""
        return self.feed("", final=True)


def _partial_suffix(text: str, marker: str, start: int) -> int:
    """Length of the longest proper prefix of ``marker`` that ``text[start:]`` ends with."""
    for n in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def think_then(answer: Grammar) -> Grammar:
    """Free thinking up to the first ``</think>``, then ``answer``: a constraint on the answer only."""
    b = GrammarBuilder(strict=True, whitespace="flexible")
    thinking = b.text_without(THINK_CLOSE, name="thinking")
    return Grammar.concat(b.build(seq(thinking, lit(THINK_CLOSE))), answer)
