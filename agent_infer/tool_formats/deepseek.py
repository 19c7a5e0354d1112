"""DeepSeek tool calls, written with DeepSeek's special tokens.

Two generations share the tokens (each a single id in the DeepSeek-V3/V4 tokenizer):

* V3 (``deepseek_v3``): ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``,
  calls separated by a newline, results in ``<｜tool▁outputs▁begin｜>...<｜tool▁outputs▁end｜>``.
* V3.1 and later (``deepseek_v31``): ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``,
  calls chained without separators, each result in ``<｜tool▁output▁begin｜>...<｜tool▁output▁end｜>``.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Sequence

from agent_infer.grammar.ir import Expr, alt, lit, seq
from agent_infer.tool_formats.base import ToolCall, ToolCallFormat
from agent_infer.tool_formats.grammar_parts import GrammarBuilder, repeat_calls
from agent_infer.tool_formats.scanning import Layout, Piece, call_piece, text_until
from agent_infer.tools import Tool

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"
OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
OUTPUTS_END = "<｜tool▁outputs▁end｜>"
OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
OUTPUT_END = "<｜tool▁output▁end｜>"
SPECIAL_TOKENS = (
    CALLS_BEGIN,
    CALLS_END,
    CALL_BEGIN,
    CALL_END,
    SEP,
    OUTPUTS_BEGIN,
    OUTPUTS_END,
    OUTPUT_BEGIN,
    OUTPUT_END,
)

V3_CALL_TYPE = "function"
V3_ARGS_OPEN = "\n```json\n"
V3_ARGS_CLOSE = "\n```"

W = Layout.WS


class _DeepSeekBase(ToolCallFormat):
    """What both generations share: the calls block, its scanning and the grammar's shape."""

    call_separator = ""
    delimiters = SPECIAL_TOKENS
    _layout: Layout

    @abstractmethod
    def _call_text(self, name: str, args_json: str) -> str:
        """One call's text."""

    @abstractmethod
    def _call_expr(self, name: str, args: Expr) -> Expr:
        """One call of tool ``name`` in the grammar."""

    @abstractmethod
    def _format_line(self) -> str:
        """The call syntax spelled out for the tools prompt."""

    def tools_prompt(self, tools: Sequence[Tool]) -> str:
        described = "\n\n".join(
            f"### {t.name}\nDescription: {t.description}\n\nParameters: {json.dumps(t.parameters, ensure_ascii=False)}"
            for t in tools
        )
        return (
            f"## Tools\nYou have access to the following tools:\n\n{described}\n\n"
            f"IMPORTANT: ALWAYS adhere to this exact format for tool use:\n{self._format_line()}\n\n"
            "Where:\n- `tool_call_name` must be an exact match to one of the available tools\n"
            "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema"
        )

    def render_assistant_tool_calls(self, calls: Sequence[ToolCall]) -> str:
        body = self.call_separator.join(
            self._call_text(c.name, json.dumps(c.arguments, ensure_ascii=False)) for c in calls
        )
        return f"{CALLS_BEGIN}{body}{CALLS_END}"

    def _scan(self, text: str, final: bool, start: int = 0) -> list[Piece]:
        pieces: list[Piece] = []
        pos = start
        while True:
            k, text_piece = text_until(text, pos, CALLS_BEGIN, final)
            pieces.append(text_piece)
            if k < 0:
                return pieces
            p = k + len(CALLS_BEGIN)
            n_calls = 0
            while True:
                p += len(text[p:]) - len(text[p:].lstrip())
                rest = text[p:]
                if rest.startswith(CALLS_END):
                    pos = p + len(CALLS_END)
                    pieces.append(Piece(False, "", resume=pos))
                    break
                if rest.startswith(CALL_BEGIN):
                    status, end, name, args = self._layout.match(text, p, final)
                    piece = call_piece(status, name, args)
                    if piece is not None:
                        pieces.append(piece)
                        if not piece.complete:
                            return pieces
                        n_calls += 1
                        p = end
                        continue
                elif not final and (CALLS_END.startswith(rest) or CALL_BEGIN.startswith(rest)):
                    return pieces  # the next token is still arriving
                # Broken block: keep the calls before the break, the rest is text.
                if n_calls:
                    pos = p
                else:
                    pieces.append(Piece(False, CALLS_BEGIN))
                    pos = k + len(CALLS_BEGIN)
                pieces.append(Piece(False, "", resume=pos))
                break

    def _plain_text(self, b: GrammarBuilder) -> Expr:
        return b.text_without(CALLS_BEGIN)

    def _calls(self, b: GrammarBuilder, mode: str, allowed: list[Tool], parallel: bool) -> Expr:
        call = b.add(
            "call", alt(*(self._call_expr(t.name, b.arguments(i, t)) for i, t in enumerate(allowed)))
        )
        sep = lit(self.call_separator)
        return b.add("block", seq(lit(CALLS_BEGIN), repeat_calls(call, sep, parallel), lit(CALLS_END)))


class DeepSeekV3Format(_DeepSeekBase):
    """DeepSeek-V3 / R1: typed calls with arguments in a fenced JSON block."""

    name = "deepseek_v3"
    call_separator = "\n"
    _layout = Layout(
        CALL_BEGIN, V3_CALL_TYPE, SEP, ("until", "\n"), W, "```json", W, Layout.ARGS, W, "```", W, CALL_END
    )

    def _call_text(self, name: str, args_json: str) -> str:
        return f"{CALL_BEGIN}{V3_CALL_TYPE}{SEP}{name}{V3_ARGS_OPEN}{args_json}{V3_ARGS_CLOSE}{CALL_END}"

    def _call_expr(self, name: str, args: Expr) -> Expr:
        return seq(
            lit(f"{CALL_BEGIN}{V3_CALL_TYPE}{SEP}{name}{V3_ARGS_OPEN}"), args, lit(V3_ARGS_CLOSE + CALL_END)
        )

    def _format_line(self) -> str:
        return (
            f"{CALLS_BEGIN}{CALL_BEGIN}{V3_CALL_TYPE}{SEP}tool_call_name{V3_ARGS_OPEN}tool_call_arguments"
            f"{V3_ARGS_CLOSE}{CALL_END}{{additional_tool_calls, one per line}}{CALLS_END}"
        )

    def render_tool_result(self, results: Sequence[tuple[str, str]]) -> dict[str, str]:
        body = "\n".join(f"{OUTPUT_BEGIN}{content}{OUTPUT_END}" for _, content in results)
        return {"role": "user", "content": f"{OUTPUTS_BEGIN}{body}{OUTPUTS_END}"}


class DeepSeekV31Format(_DeepSeekBase):
    """DeepSeek-V3.1 and later: ``NAME<｜tool▁sep｜>{json}`` calls chained directly."""

    name = "deepseek_v31"
    _layout = Layout(CALL_BEGIN, ("until", SEP), SEP, W, Layout.ARGS, W, CALL_END)

    def _call_text(self, name: str, args_json: str) -> str:
        return f"{CALL_BEGIN}{name}{SEP}{args_json}{CALL_END}"

    def _call_expr(self, name: str, args: Expr) -> Expr:
        return seq(lit(f"{CALL_BEGIN}{name}{SEP}"), args, lit(CALL_END))

    def _format_line(self) -> str:
        return (
            f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{SEP}tool_call_arguments{CALL_END}"
            f"{{additional_tool_calls}}{CALLS_END}\n(For multiple tool calls, chain them directly without "
            "separators or spaces.)"
        )

    def render_tool_result(self, results: Sequence[tuple[str, str]]) -> dict[str, str]:
        return {
            "role": "user",
            "content": "".join(f"{OUTPUT_BEGIN}{content}{OUTPUT_END}" for _, content in results),
        }


__all__ = ["SPECIAL_TOKENS", "DeepSeekV3Format", "DeepSeekV31Format"]
