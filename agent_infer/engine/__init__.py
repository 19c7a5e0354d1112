"""The inference engine: scheduler, paged KV blocks, model runner, sampler and the step loop."""

from __future__ import annotations

from agent_infer.engine.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.engine.output import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["CompletionOutput", "EngineConfig", "LLMEngine", "RequestMetrics", "RequestOutput"]
