"""The errors and warnings of tool definitions and tool calls."""

from __future__ import annotations

from typing import Any

from agent_infer.errors import InvalidRequestError


class ToolDefinitionError(InvalidRequestError):
    """A function cannot become a tool (``*args``, bad name, unsupported annotation) or tools clash."""


class ToolArgumentsError(InvalidRequestError):
    """Arguments of a tool call do not match the tool's parameters. ``errors`` lists each problem."""

    def __init__(self, message: str, *, tool: str, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message, field="arguments")
        self.tool = tool
        self.errors = errors or []


class ToolRetry(Exception):
    """Raised by a tool to ask the model for a corrected call; the message is shown to the model."""


class AnyJSONWarning(UserWarning):
    """A parameter or field has no type the schema can express (no annotation, ``object``, ``Any``),
    so the model may write any JSON value there."""
