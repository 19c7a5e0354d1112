"""Llama 3.1 / 3.2 JSON tool calls: ``{"name": ..., "parameters": {...}}`` as the whole reply.

Meta's documented JSON (custom tool) calling: the tools and the instruction go into the first user
message, the model answers with nothing but the JSON call, optionally after ``<|python_tag|>``,
and the result comes back in an ``ipython`` turn. The 3.1 template asks for one call per turn;
parallel calls are written separated by ``; `` (a newline is accepted too), as vLLM's parser reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from agent_infer.grammar.ir import Expr, alt, lit, opt, seq
from agent_infer.tool_formats.base import ToolCall, ToolCallFormat
from agent_infer.tool_formats.grammar_parts import GrammarBuilder, repeat_calls
from agent_infer.tool_formats.scanning import Layout, Piece, call_piece
from agent_infer.tools import Tool

PYTHON_TAG = "<|python_tag|>"
TOOL_RESULT_ROLE = "ipython"
CALL_SEPARATOR = "; "
SEPARATORS = ("; ", ";", "\n")
ARGUMENTS_KEY = '"parameters"'

W = Layout.WS
# Llama writes "parameters"; "arguments" is accepted on input because fine-tunes mix them up.
_CALL = Layout(
    W,
    "{",
    W,
    '"name"',
    W,
    ":",
    W,
    Layout.NAME_STR,
    W,
    ",",
    W,
    (ARGUMENTS_KEY, '"arguments"'),
    W,
    ":",
    W,
    Layout.ARGS,
    W,
    "}",
)
_SEP = re.compile(r"\s*;?\s*")
# A reply that opens like a call is parsed as calls, so free text may not open like one.
_CALL_STARTS = ("{", PYTHON_TAG, " ", "\t", "\n", "\r")


class Llama3JsonFormat(ToolCallFormat):
    """Llama 3.1 / 3.2 / 3.3 JSON-based tool calling, results in the ``ipython`` role."""

    name = "llama3_json"
    delimiters = (PYTHON_TAG,)

    def tools_in_user_message(self) -> bool:
        return True  # what Llama 3.1's template does by default (tools_in_user_message=true)

    def tools_prompt(self, tools: Sequence[Tool]) -> str:
        listing = "\n\n".join(json.dumps(t.to_openai(), indent=4, ensure_ascii=False) for t in tools)
        return (
            "Given the following functions, please respond with a JSON for a function call with its proper "
            "arguments that best answers the given prompt.\n\n"
            'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
            "value}. Do not use variables.\n\n"
            f"{listing}"
        )

    def render_assistant_tool_calls(self, calls: Sequence[ToolCall]) -> str:
        return CALL_SEPARATOR.join(
            json.dumps({"name": c.name, "parameters": c.arguments}, ensure_ascii=False) for c in calls
        )

    def render_tool_result(self, results: Sequence[tuple[str, str]]) -> dict[str, str]:
        return {"role": TOOL_RESULT_ROLE, "content": "\n".join(content for _, content in results)}

    def _scan(self, text: str, final: bool, start: int = 0) -> list[Piece]:
        # A reply is all calls or all text, decided as a whole, so no piece sets a resume point
        # and ``start`` is always 0.
        pos = len(text) - len(text.lstrip())
        body = text[pos:]
        if not final and (not body or (PYTHON_TAG.startswith(body) and body != PYTHON_TAG)):
            return [Piece(False, "")]  # cannot tell yet whether this reply is a call
        if body.startswith(PYTHON_TAG):
            pos += len(PYTHON_TAG)
            pos += len(text[pos:]) - len(text[pos:].lstrip())
        if not text.startswith("{", pos) and not (not final and pos == len(text)):
            return [Piece(False, text)]
        pieces: list[Piece] = []
        while True:
            status, end, name, args = _CALL.match(text, pos, final)
            piece = call_piece(status, name, args)
            if piece is None:
                break
            pieces.append(piece)
            if not piece.complete:
                return pieces
            pos = _SEP.match(text, end).end()  # type: ignore[union-attr]
            if pos == len(text):
                # Trailing whitespace or a separator with nothing after it yet.
                return pieces
            if not text.startswith("{", pos):
                break
        # Not a call: without calls before it the whole reply is text; after calls (which the
        # stream may already have sent) the rest is text, so that no streamed call is taken back.
        return [*pieces, Piece(False, text[pos:])] if pieces else [Piece(False, text)]

    def _plain_text(self, b: GrammarBuilder) -> Expr:
        return b.text_not_starting(_CALL_STARTS)

    def _calls(self, b: GrammarBuilder, mode: str, allowed: list[Tool], parallel: bool) -> Expr:
        ws = b.ws()
        call = b.add(
            "call", seq(lit("{"), ws, b.call_members(allowed, json.loads(ARGUMENTS_KEY)), ws, lit("}"))
        )
        sep = alt(*(lit(s) for s in SEPARATORS))
        return b.add("calls", seq(opt(lit(PYTHON_TAG)), repeat_calls(call, sep, parallel)))

    def _text_or_calls(self, b: GrammarBuilder, calls: Expr) -> Expr:
        # A reply is either calls or text, never text then calls (the call must open the reply).
        return alt(calls, self._plain_text(b))


__all__ = ["PYTHON_TAG", "TOOL_RESULT_ROLE", "Llama3JsonFormat"]
