"""agent-infer: structured-output-centric inference for agents.

Heavy parts (torch engine, grammar compiler) load lazily on first attribute access, so
``import agent_infer`` stays cheap for users who only need the grammar tools or the client.
"""

from __future__ import annotations

import importlib
from typing import Any

from agent_infer.errors import AgentInferError

__version__ = "0.1.0"

_LAZY = {
    "LLM": "agent_infer.llm",
    "SamplingParams": "agent_infer.sampling_params",
    "RequestOutput": "agent_infer.engine.output",
    "Grammar": "agent_infer.grammar",
    "GrammarCompiler": "agent_infer.grammar",
    "GrammarMatcher": "agent_infer.grammar",
    "TokenizerInfo": "agent_infer.grammar",
    "Client": "agent_infer.client",
    "AsyncClient": "agent_infer.client",
    "RunResult": "agent_infer.client",
    "Completion": "agent_infer.client",
    "UsageLimits": "agent_infer.client",
    "LoopControl": "agent_infer.client",
    "tool": "agent_infer.tools",
    "Tool": "agent_infer.tools",
    "ToolRetry": "agent_infer.tools",
    "ValidationRetryError": "agent_infer.errors",
    "MaxTurnsExceeded": "agent_infer.errors",
    "UsageLimitExceeded": "agent_infer.errors",
    "IncompleteToolCallError": "agent_infer.errors",
    "ToolCallError": "agent_infer.errors",
    "RemoteError": "agent_infer.errors",
    "UnsupportedSchemaError": "agent_infer.errors",
    "ConstraintWarning": "agent_infer.errors",
}

__all__ = ["AgentInferError", "__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agent_infer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
