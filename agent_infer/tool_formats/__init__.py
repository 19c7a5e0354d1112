"""Native tool-call formats: how tools enter the prompt, how calls are parsed, and their grammars.

``get_format(name)`` returns a format; ``detect_format(chat_template)`` guesses one from a model's
chat template. Each format lives in one module with its delimiters (see ``docs/tools.md``).
"""

from __future__ import annotations

from agent_infer.tool_formats.base import (
    ContentDelta,
    ParsedOutput,
    StreamEvent,
    StreamParser,
    ToolCall,
    ToolCallDelta,
    ToolCallFormat,
)
from agent_infer.tool_formats.deepseek import CALLS_BEGIN, SEP, DeepSeekV3Format, DeepSeekV31Format
from agent_infer.tool_formats.hermes import CALL_OPEN, HermesFormat
from agent_infer.tool_formats.llama3 import PYTHON_TAG, TOOL_RESULT_ROLE, Llama3JsonFormat
from agent_infer.tools import ToolDefinitionError

__all__ = [
    "ContentDelta",
    "DeepSeekV3Format",
    "DeepSeekV31Format",
    "HermesFormat",
    "Llama3JsonFormat",
    "ParsedOutput",
    "StreamEvent",
    "StreamParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallFormat",
    "detect_format",
    "get_format",
    "list_formats",
]

_FORMATS: dict[str, type[ToolCallFormat]] = {
    "hermes": HermesFormat,
    "qwen": HermesFormat,
    "chatml": HermesFormat,
    "llama3_json": Llama3JsonFormat,
    "llama3": Llama3JsonFormat,
    "deepseek_v3": DeepSeekV3Format,
    "deepseek_v31": DeepSeekV31Format,
    "deepseek": DeepSeekV31Format,
}


def list_formats() -> list[str]:
    """Registered format names (aliases included)."""
    return sorted(_FORMATS)


def get_format(name: str) -> ToolCallFormat:
    """The format registered as ``name`` (e.g. ``"hermes"``, ``"llama3_json"``, ``"deepseek_v3"``)."""
    try:
        return _FORMATS[name.lower()]()
    except KeyError:
        raise ToolDefinitionError(
            f"unknown tool-call format {name!r}; available: {', '.join(list_formats())}", field="tool_format"
        ) from None


def detect_format(chat_template: str | None) -> ToolCallFormat:
    """Guess the format a chat template expects; Hermes when the template says nothing about tools."""
    template = chat_template or ""
    if CALLS_BEGIN in template or SEP in template:
        # V3 templates spell out the call type and fence the arguments; V3.1+ write NAME<sep>JSON.
        v3 = "```json" in template or f"function{SEP}" in template or "'function' + '" in template
        return DeepSeekV3Format() if v3 else DeepSeekV31Format()
    if CALL_OPEN in template:
        return HermesFormat()
    if TOOL_RESULT_ROLE in template or PYTHON_TAG in template:
        return Llama3JsonFormat()
    return HermesFormat()
