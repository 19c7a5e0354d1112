"""Model side of agent-infer: config, paged-attention Llama/Qwen2 forward pass, loaders, tokenizer.

The forward-pass contract with the engine is :class:`AttentionMetadata`, :class:`KVCache` and
:class:`LlamaForCausalLM`; loaders return a :class:`~agent_infer.model.loader.LoadedModel`.
"""

from __future__ import annotations

from agent_infer.model.attention import AttentionMetadata
from agent_infer.model.config import ModelConfig
from agent_infer.model.kv_cache import KVCache
from agent_infer.model.llama import LlamaForCausalLM

__all__ = ["AttentionMetadata", "KVCache", "LlamaForCausalLM", "ModelConfig"]
