"""Model side of agent-infer: config, paged-attention Llama/Qwen2 forward pass, loaders, tokenizer.

The forward-pass contract with the engine is :class:`AttentionMetadata`, :class:`KVCache` and
:class:`LlamaForCausalLM`; :func:`load_model` returns a :class:`LoadedModel` holding all of them.
"""

from __future__ import annotations

from agent_infer.model.attention import AttentionMetadata
from agent_infer.model.config import ModelConfig
from agent_infer.model.kv_cache import KVCache
from agent_infer.model.llama import LlamaForCausalLM
from agent_infer.model.loader import LoadedModel, default_model_path, load_model
from agent_infer.model.tokenizer import Tokenizer

__all__ = [
    "AttentionMetadata",
    "KVCache",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "Tokenizer",
    "default_model_path",
    "load_model",
]
