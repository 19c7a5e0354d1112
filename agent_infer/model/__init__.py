"""Model side of agent-infer: architecture families over shared layers, loaders, tokenizer.

``layers/`` holds what families share (norms, rotary, attention backends, linear layers, MLP, MoE)
and the load-time choice of kernels; ``families/`` one module per architecture family;
:mod:`.registry` maps checkpoint architecture names to families; ``loading/`` reads GGUF files and
Hugging Face directories. The forward-pass contract with the engine is :class:`AttentionMetadata`,
:class:`KVCache` and :class:`CausalLM`; :func:`load_model` returns a :class:`LoadedModel` holding all of them.
"""

from __future__ import annotations

from agent_infer.model.config import ModelConfig
from agent_infer.model.families.base import CausalLM
from agent_infer.model.families.llama import LlamaForCausalLM
from agent_infer.model.kv_cache import KVCache
from agent_infer.model.layers.attention import AttentionMetadata
from agent_infer.model.loader import LoadedModel, default_model_path, load_model
from agent_infer.model.tokenizer import Tokenizer

__all__ = [
    "AttentionMetadata",
    "CausalLM",
    "KVCache",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelConfig",
    "Tokenizer",
    "default_model_path",
    "load_model",
]
