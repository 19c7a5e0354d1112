"""Tools an agent can call: typed Python functions become JSON-Schema-described :class:`Tool` objects.

A plain function (sync or async) or one decorated with :func:`tool` is turned into a ``Tool``
whose ``parameters`` JSON Schema comes from the signature through Pydantic and whose description
(and per-parameter descriptions) come from the docstring (Google, numpy or Sphinx style).
How tool calls look in a model's output is the job of :mod:`agent_infer.tool_formats`.
"""

from agent_infer.docstrings import parse_docstring
from agent_infer.tools.context import RunContext
from agent_infer.tools.errors import AnyJSONWarning, ToolArgumentsError, ToolDefinitionError, ToolRetry
from agent_infer.tools.tool import Tool, as_tools, tool

__all__ = [
    "AnyJSONWarning",
    "RunContext",
    "Tool",
    "ToolArgumentsError",
    "ToolDefinitionError",
    "ToolRetry",
    "as_tools",
    "parse_docstring",
    "tool",
]
