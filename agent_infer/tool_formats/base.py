"""The interface every native tool-call format implements, its value types and the stream parser.

A format owns three views of one syntax -- how tools and calls are *rendered* into a prompt, how
calls are *parsed* out of output (whole or streamed), and the *grammar* that constrains output --
so its delimiter constants live in one module and cannot drift apart.

Parsing works on "pieces" (``scanning.py``): a format's ``_scan(text, final)`` splits the text into
text pieces and call pieces (name and raw argument JSON, possibly unfinished when ``final`` is
false). Whole-text parsing and the stream parser both assemble pieces the same way, which is what
makes a streamed result equal the whole-text result at every split point.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent_infer.grammar.ir import Expr, Grammar, opt, seq
from agent_infer.tool_formats.grammar_parts import GrammarBuilder, ToolChoice, resolve_choice
from agent_infer.tool_formats.scanning import Piece, assemble, merge_text
from agent_infer.tools import Tool


def new_call_id() -> str:
    """A fresh OpenAI-style call id (formats without ids in their syntax get one on parse)."""
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    """One call: tool ``name`` and decoded ``arguments``. ``id`` and ``arguments_text`` do not take part in equality.

    ``arguments_text`` is the arguments' JSON exactly as the model wrote it (set by parsing); the
    stream parser sends that same text in its deltas, so reporting it keeps a whole answer equal to
    the concatenated stream whatever spacing the model chose.
    """

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=new_call_id, compare=False)
    arguments_text: str | None = field(default=None, compare=False, repr=False)

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry: arguments as the model's JSON text, or serialized when built in code."""
        text = self.arguments_text
        if text is None:
            text = json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": text}}


@dataclass(frozen=True)
class ParsedOutput:
    """Model output split into its free-text ``content`` and its ``tool_calls``.

    ``unfinished_call`` is set only by :meth:`ToolCallFormat.parse_cut_off` when the output stopped
    inside a call: the tool's name, or "" when the cut came before the name.
    """

    content: str
    tool_calls: list[ToolCall]
    unfinished_call: str | None = None


@dataclass(frozen=True)
class ContentDelta:
    """Newly available free text."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A tool-call delta, OpenAI-shaped: the first for an ``index`` carries ``id`` and ``name``."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """The ``choices[].delta.tool_calls[]`` entry of a chat-completions chunk."""
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index, "function": function}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        return out


StreamEvent = ContentDelta | ToolCallDelta


ChatRender = Callable[[list[dict[str, Any]]], str]


class ToolCallFormat(ABC):
    """A model family's native tool-calling syntax: render, parse, stream-parse and constrain."""

    name: str = ""
    content_separator = ""  # between an assistant's text and its calls in a transcript
    # Delimiters the model's tokenizer usually has as single (added) tokens. Constrained decoding
    # must let those tokens stand for their text, or the model has to spell them piecewise.
    delimiters: tuple[str, ...] = ()

    # -- prompt side --

    @abstractmethod
    def tools_prompt(self, tools: Sequence[Tool]) -> str:
        """The text that tells the model which tools exist and how to call them."""

    @abstractmethod
    def render_assistant_tool_calls(self, calls: Sequence[ToolCall]) -> str:
        """The assistant-turn text of ``calls`` exactly as the model writes it."""

    @abstractmethod
    def render_tool_result(self, results: Sequence[tuple[str, str]]) -> dict[str, str]:
        """One message carrying the results of consecutive tool calls, as ``(name, content)`` pairs."""

    def tools_in_user_message(self) -> bool:
        """Whether the tools prompt goes into the first user message instead of the system message."""
        return False

    def render_tools(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Tool],
        chat_template_render: ChatRender | None = None,
    ) -> list[dict[str, Any]] | str:
        """Put the tools into the prompt and rewrite tool transcripts into this format.

        OpenAI-style ``assistant`` messages with ``tool_calls`` become assistant text, runs of
        ``tool`` messages become :meth:`render_tool_result` messages. With ``chat_template_render``
        (a function from messages to prompt text) the rendered prompt is returned, else the messages.
        """
        names: dict[str, str] = {}
        out: list[dict[str, Any]] = []
        pending: list[tuple[str, str]] = []
        for message in messages:
            msg = dict(message)
            if msg.get("role") == "tool":
                name = msg.get("name") or names.get(msg.get("tool_call_id", ""), "")
                content = msg.get("content")
                pending.append((name, content if isinstance(content, str) else json.dumps(content)))
                continue
            if pending:
                out.append(self.render_tool_result(pending))
                pending = []
            if msg.get("role") == "assistant" and msg.get("tool_calls"):
                calls = [_call_from_openai(c) for c in msg.pop("tool_calls")]
                names.update((c.id, c.name) for c in calls)
                text = msg.get("content") or ""
                sep = self.content_separator if text else ""
                msg["content"] = text + sep + self.render_assistant_tool_calls(calls)
            out.append(msg)
        if pending:
            out.append(self.render_tool_result(pending))
        if tools:
            out = self._insert_tools_prompt(out, self.tools_prompt(tools))
        return chat_template_render(out) if chat_template_render is not None else out

    def _insert_tools_prompt(self, messages: list[dict[str, Any]], prompt: str) -> list[dict[str, Any]]:
        role = "user" if self.tools_in_user_message() else "system"
        for i, msg in enumerate(messages):
            if msg.get("role") == role:
                messages[i] = {**msg, "content": _join(prompt, msg.get("content") or "", role)}
                return messages
            if role == "system" and msg.get("role") != "system":
                break
        if role == "user":  # no user message yet: the tools still need a home
            return [*messages, {"role": "user", "content": prompt}]
        return [{"role": "system", "content": prompt}, *messages]

    # -- output side --

    @abstractmethod
    def _scan(self, text: str, final: bool, start: int = 0) -> list[Piece]:
        """Split ``text[start:]`` into pieces. Not ``final``: the text may continue, so hold back what may change.

        ``start`` is 0 or a ``resume`` offset of an earlier scan of a prefix of ``text``.
        """

    def parse(self, text: str) -> ParsedOutput:
        """The content and tool calls of a complete output."""
        content, calls = assemble(self._scan(text, True))
        return ParsedOutput(content, [_call_of(p) for p in calls])

    def parse_cut_off(self, text: str) -> ParsedOutput:
        """The content and complete calls of an output that was cut off (``max_tokens``).

        A call opened but not finished is neither content nor a call: it is reported as
        ``unfinished_call`` so that the caller can tell a cut-off call from a text answer.
        """
        pieces = self._scan(text, False)
        open_calls = [p for p in pieces if p.is_call and not p.complete]
        if not open_calls:
            return self.parse(text)
        content, calls = assemble([p for p in pieces if not (p.is_call and not p.complete)], True)
        return ParsedOutput(
            content,
            [_call_of(p) for p in calls],
            open_calls[0].name or "",
        )

    def stream_parser(self) -> StreamParser:
        """An incremental parser: ``feed(delta)`` as text arrives, ``finish()`` at the end."""
        return StreamParser(self)

    def grammar(
        self,
        tools: Sequence[Tool],
        *,
        tool_choice: ToolChoice = "auto",
        parallel_tool_calls: bool = True,
        strict: bool = True,
        whitespace: str = "flexible",
    ) -> Grammar:
        """The grammar of outputs allowed under ``tool_choice`` (auto / required / none / {"name": X})."""
        mode, allowed = resolve_choice(tools, tool_choice)
        b = GrammarBuilder(strict, whitespace)
        if mode == "none":
            return b.build(self._plain_text(b))
        calls = self._calls(b, mode, allowed, parallel_tool_calls and mode != "named")
        if mode in ("required", "named"):
            return b.build(calls)
        return b.build(self._text_or_calls(b, calls))

    @abstractmethod
    def _plain_text(self, b: GrammarBuilder) -> Expr:
        """Free text that cannot open a call (tool_choice "none")."""

    @abstractmethod
    def _calls(self, b: GrammarBuilder, mode: str, allowed: list[Tool], parallel: bool) -> Expr:
        """The call block: one call of ``allowed`` tools, or with ``parallel`` several."""

    def _text_or_calls(self, b: GrammarBuilder, calls: Expr) -> Expr:
        """tool_choice "auto": text, optionally followed by calls."""
        return seq(self._plain_text(b), opt(calls))


def _call_of(piece: Piece) -> ToolCall:
    return ToolCall(piece.name or "", json.loads(piece.arguments), arguments_text=piece.arguments)


def _join(prompt: str, content: str, role: str) -> str:
    if not content:
        return prompt
    return f"{content}\n\n{prompt}" if role == "system" else f"{prompt}\n\n{content}"


def _call_from_openai(entry: Mapping[str, Any]) -> ToolCall:
    fn = entry.get("function", entry)
    args = fn.get("arguments", {})
    return ToolCall(
        fn["name"],
        json.loads(args) if isinstance(args, str) else dict(args),
        entry.get("id") or new_call_id(),
    )


class StreamParser:
    """Incremental parsing: each ``feed`` rescans the unsettled tail of the output and emits what became certain.

    Pieces up to the last ``resume`` point are settled (``_frozen``), so the rescan covers only the
    current call or the text since the last settled point, not the whole output.
    """

    def __init__(self, fmt: ToolCallFormat) -> None:
        self._fmt = fmt
        self._text = ""
        self._frozen: list[Piece] = []
        self._base = 0
        self._sent = ""  # content emitted so far
        self._calls: list[tuple[str, int]] = []  # (id, characters of arguments emitted)

    def feed(self, delta: str) -> list[StreamEvent]:
        """Add ``delta`` to the output; returns the new content and tool-call deltas."""
        self._text += delta
        pieces = self._fmt._scan(self._text, False, self._base)
        events = self._emit([*self._frozen, *pieces], False)
        settled = [i for i, p in enumerate(pieces) if p.resume is not None]
        if settled:
            self._frozen = merge_text([*self._frozen, *pieces[: settled[-1] + 1]])
            self._base = pieces[settled[-1]].resume or 0
        return events

    def finish(self) -> list[StreamEvent]:
        """The output is complete: flush text that was held back in case it started a call."""
        return self._emit([*self._frozen, *self._fmt._scan(self._text, True, self._base)], True)

    def _emit(self, pieces: list[Piece], final: bool) -> list[StreamEvent]:
        content, calls = assemble(pieces, final)
        events: list[StreamEvent] = []
        # Text is only reported once no later input can make it part of a call, so content only
        # grows; the check guards the promise rather than trusting it.
        if len(content) > len(self._sent) and content.startswith(self._sent):
            events.append(ContentDelta(content[len(self._sent) :]))
            self._sent = content
        for index, p in enumerate(calls):
            if p.name is None:
                break
            if index == len(self._calls):
                self._calls.append((new_call_id(), 0))
                events.append(ToolCallDelta(index, id=self._calls[index][0], name=p.name))
            call_id, sent = self._calls[index]
            if len(p.arguments) > sent:
                events.append(ToolCallDelta(index, arguments=p.arguments[sent:]))
                self._calls[index] = (call_id, len(p.arguments))
        return events
