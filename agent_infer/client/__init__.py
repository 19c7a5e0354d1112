"""The agent-facing SDK: :class:`Client` / :class:`AsyncClient` on a local model or a remote server.

See ``docs/sdk.md``. ``generate(schema=...)`` returns validated values, ``generate_stream`` yields
partial objects, ``chat(tools=...)`` returns OpenAI-shaped assistant messages, ``run`` is the
agent loop.
"""

from __future__ import annotations

from agent_infer.client.agent import RunResult
from agent_infer.client.async_client import AsyncClient
from agent_infer.client.client import Client
from agent_infer.client.hooks import Hooks, ParseErrorEvent, RequestEvent, ResponseEvent, ToolCallEvent
from agent_infer.client.loop_control import STRUCTURED_LOOP_CONTROL, LoopControl
from agent_infer.client.request import Completion, StreamChunk, Usage, UsageLimits
from agent_infer.tools import RunContext

__all__ = [
    "STRUCTURED_LOOP_CONTROL",
    "AsyncClient",
    "Client",
    "Completion",
    "Hooks",
    "LoopControl",
    "ParseErrorEvent",
    "RequestEvent",
    "ResponseEvent",
    "RunContext",
    "RunResult",
    "StreamChunk",
    "ToolCallEvent",
    "Usage",
    "UsageLimits",
]
