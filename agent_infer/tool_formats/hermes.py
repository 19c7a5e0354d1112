"""Hermes / Qwen tool calls: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``.

Tools are listed as JSON inside ``<tools></tools>`` in the system message and results come back
in a user turn wrapped in ``<tool_response>``, as Qwen2.5's chat template does. Plain ChatML
templates without a tool section (SmolLM2's) get the same system text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from agent_infer.grammar.ir import Expr, lit, seq
from agent_infer.tool_formats.base import ToolCall, ToolCallFormat
from agent_infer.tool_formats.grammar_parts import GrammarBuilder, repeat_calls
from agent_infer.tool_formats.scanning import Layout, Piece, call_piece, scan_object, text_until
from agent_infer.tools import Tool

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
TOOLS_OPEN = "<tools>"
TOOLS_CLOSE = "</tools>"
RESPONSE_OPEN = "<tool_response>"
RESPONSE_CLOSE = "</tool_response>"
CALL_SEPARATOR = "\n"

W = Layout.WS
# Name first, as every Hermes-style model writes it; that order is what lets the name stream early.
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
    '"arguments"',
    W,
    ":",
    W,
    Layout.ARGS,
    W,
    "}",
    W,
    CALL_CLOSE,
)
_CLOSE = Layout(W, CALL_CLOSE)


class HermesFormat(ToolCallFormat):
    """Hermes-2-Pro / Qwen2.5 / Qwen3 style ``<tool_call>`` blocks (also used for plain ChatML models)."""

    name = "hermes"
    content_separator = "\n"
    delimiters = (CALL_OPEN, CALL_CLOSE)

    def tools_prompt(self, tools: Sequence[Tool]) -> str:
        listing = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
        return (
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within {TOOLS_OPEN}{TOOLS_CLOSE} XML tags:\n"
            f"{TOOLS_OPEN}\n{listing}\n{TOOLS_CLOSE}\n\n"
            "For each function call, return a json object with function name and arguments within "
            f"{CALL_OPEN}{CALL_CLOSE} XML tags:\n"
            f'{CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_CLOSE}'
        )

    def render_assistant_tool_calls(self, calls: Sequence[ToolCall]) -> str:
        return CALL_SEPARATOR.join(
            f"{CALL_OPEN}\n"
            + json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)
            + f"\n{CALL_CLOSE}"
            for c in calls
        )

    def render_tool_result(self, results: Sequence[tuple[str, str]]) -> dict[str, str]:
        body = "\n".join(f"{RESPONSE_OPEN}\n{content}\n{RESPONSE_CLOSE}" for _, content in results)
        return {"role": "user", "content": body}

    def _scan(self, text: str, final: bool, start: int = 0) -> list[Piece]:
        pieces: list[Piece] = []
        pos = start
        while True:
            k, text_piece = text_until(text, pos, CALL_OPEN, final)
            pieces.append(text_piece)
            if k < 0:
                return pieces
            body = k + len(CALL_OPEN)
            status, end, name, args = _CALL.match(text, body, final)
            if status == "fail":
                piece, end = _any_order_call(text, body, final)
            else:
                piece = call_piece(status, name, args)
            if piece is None:  # not a call after all: the tag is plain text
                pieces.append(Piece(False, CALL_OPEN, resume=body))
                pos = body
                continue
            pieces.append(piece)
            if not piece.complete:
                return pieces
            pos = end
            piece.resume = pos

    def _plain_text(self, b: GrammarBuilder) -> Expr:
        return b.text_without(CALL_OPEN)

    def _calls(self, b: GrammarBuilder, mode: str, allowed: list[Tool], parallel: bool) -> Expr:
        ws = b.ws()
        call = b.add(
            "call",
            seq(
                lit(CALL_OPEN + "\n{"), ws, b.call_members(allowed, "arguments"), ws, lit("}\n" + CALL_CLOSE)
            ),
        )
        if mode == "named":
            return call
        return b.add("calls", repeat_calls(call, lit(CALL_SEPARATOR), parallel))


def _any_order_call(text: str, start: int, final: bool) -> tuple[Piece | None, int]:
    """Fallback for envelopes the streaming layout does not expect (other key order, "parameters").

    Such a call is only reported once complete, name and arguments together.
    """
    pos = start
    while pos < len(text) and text[pos].isspace():
        pos += 1
    end = scan_object(text, pos)
    if end is None:
        return (None if final else Piece(True)), pos
    if end < 0:
        return None, pos
    status, after, _, _ = _CLOSE.match(text, end, final)
    if status != "ok":
        return (Piece(True) if status == "partial" else None), pos
    try:
        obj = json.loads(text[pos:end])
        args = obj.get("arguments", obj.get("parameters", {}))
        args = json.loads(args) if isinstance(args, str) else args
    except (json.JSONDecodeError, AttributeError):
        return None, pos
    if not isinstance(obj.get("name"), str) or not isinstance(args, dict):
        return None, pos
    raw = json.dumps(args, ensure_ascii=False)
    return Piece(True, name=obj["name"], arguments=raw, complete=True), after


__all__ = ["CALL_CLOSE", "CALL_OPEN", "HermesFormat"]
