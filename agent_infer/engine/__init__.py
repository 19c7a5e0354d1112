"""The inference engine: the step loop (schedule, run, postprocess) over paged KV blocks, the model runner,
sampler, speculator and grammar masks."""

from __future__ import annotations

from agent_infer.engine.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.engine.output import CompletionOutput, RequestMetrics, RequestOutput

__all__ = ["CompletionOutput", "EngineConfig", "LLMEngine", "RequestMetrics", "RequestOutput"]
