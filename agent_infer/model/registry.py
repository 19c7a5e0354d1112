"""The architectures agent-infer runs, keyed by the names checkpoints give them.

A Hugging Face ``config.json`` names its class in ``architectures`` (``LlamaForCausalLM``; its
``model_type`` when that list is absent); a GGUF file names its ``general.architecture``
(``llama``). Both resolve here, in one table, to an :class:`Architecture`: the family class that
builds the model and the few facts the loaders need about the checkpoint's layout. A new family is
a module under ``families/`` and its rows in :data:`ARCHITECTURES`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agent_infer.errors import UnsupportedModelError
from agent_infer.model.config import ModelConfig
from agent_infer.model.families import (
    deepseek_chat,
    deepseek_v3,
    deepseek_v4,
    deepseek_v4_checkpoint,
    gemma3,
    gemma3_checkpoint,
    llama,
    qwen3,
    qwen3_moe,
)
from agent_infer.model.families.base import CausalLM
from agent_infer.model.layers.kernels import Kernels


@dataclass(frozen=True)
class Architecture:
    """One architecture: the names checkpoints use for it, its family, and its checkpoint layout."""

    #: ``ModelConfig.architecture``; also the GGUF ``general.architecture`` and its metadata key prefix.
    name: str
    #: The Hugging Face ``architectures`` entries (and ``model_type``) that mean this architecture.
    hf_names: tuple[str, ...]
    family: type[CausalLM]
    #: GGUF tensor names -> HF names, outside the blocks and per block (``blk.N.<name>``).
    gguf_global_names: Mapping[str, str]
    gguf_layer_names: Mapping[str, str]
    #: llama.cpp's converter stores q/k rows permuted for its interleaved RoPE (LLaMA only).
    gguf_permutes_qk: bool
    #: HF checkpoints always carry q/k/v biases.
    qkv_bias: bool
    #: Reads the architecture's own ``config.json`` fields into :class:`ModelConfig` keyword arguments
    #: (``where`` prefixes its errors); None for architectures the common fields describe.
    hf_fields: Callable[[Mapping[str, Any], str], dict[str, Any]] | None = None
    #: Per block, GGUF tensors stacking every expert ``[E, ...]`` -> the HF name of expert ``{e}``.
    gguf_expert_names: Mapping[str, str] = field(default_factory=dict)
    #: The decoder's settings of an HF ``config.json`` whose text model is nested (a multimodal
    #: wrapper's ``text_config``), as a flat dict; None: the file is read as it is.
    hf_text_config: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    #: Family-specific :class:`ModelConfig` fields from GGUF metadata and the common config.
    gguf_options: Callable[[dict[str, Any], ModelConfig], dict[str, Any]] | None = None
    #: The chat template of checkpoints of this architecture that carry none (GGUF base models,
    #: HF folders whose tokenizer files name no template).
    default_chat_template: str | None = None
    #: The folder of the tokenizer files an HF folder of this architecture without ``tokenizer.json``
    #: uses (called at load; raises ``TokenizerError`` when unavailable); None: the folder must have one.
    default_tokenizer: Callable[[], Path] | None = None
    #: Maps the tensor names of a checkpoint in a layout of its own (DeepSeek's released V4 files) to
    #: the family's, leaving the family's own names as they are; None: checkpoints use the family's.
    hf_tensor_name: Callable[[str], str] | None = None
    #: HF folders of this architecture on the CPU in float32 run their projections on the native
    #: kernel over float32 weights packed at load (layers/float_linear.py); the family accepts
    #: those kernels.
    hf_packed_linears: bool = False


ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture(
        name="llama",
        # Mistral is Llama with a sliding window (llama.cpp converts it to its llama architecture)
        hf_names=("LlamaForCausalLM", "llama", "MistralForCausalLM", "mistral"),
        family=llama.LlamaForCausalLM,
        gguf_global_names=llama.GGUF_GLOBAL_NAMES,
        gguf_layer_names=llama.GGUF_LAYER_NAMES,
        gguf_permutes_qk=True,
        qkv_bias=False,
    ),
    Architecture(
        name="qwen2",
        hf_names=("Qwen2ForCausalLM", "qwen2"),
        family=llama.LlamaForCausalLM,
        gguf_global_names=llama.GGUF_GLOBAL_NAMES,
        gguf_layer_names=llama.GGUF_LAYER_NAMES,
        gguf_permutes_qk=False,
        qkv_bias=True,
    ),
    Architecture(
        name="qwen3",
        hf_names=("Qwen3ForCausalLM", "qwen3"),
        family=qwen3.Qwen3ForCausalLM,
        gguf_global_names=llama.GGUF_GLOBAL_NAMES,
        gguf_layer_names=qwen3.GGUF_LAYER_NAMES,
        gguf_permutes_qk=False,
        qkv_bias=False,
    ),
    Architecture(
        name="qwen3moe",
        hf_names=("Qwen3MoeForCausalLM", "qwen3_moe"),
        family=qwen3_moe.Qwen3MoeForCausalLM,
        gguf_global_names=llama.GGUF_GLOBAL_NAMES,
        gguf_layer_names=qwen3_moe.GGUF_LAYER_NAMES,
        gguf_permutes_qk=False,
        qkv_bias=False,
        gguf_expert_names=qwen3_moe.GGUF_EXPERT_NAMES,
    ),
    Architecture(
        name="gemma3",
        hf_names=("Gemma3ForCausalLM", "gemma3_text", "Gemma3ForConditionalGeneration", "gemma3"),
        family=gemma3.Gemma3ForCausalLM,
        gguf_global_names=gemma3_checkpoint.GGUF_GLOBAL_NAMES,
        gguf_layer_names=gemma3_checkpoint.GGUF_LAYER_NAMES,
        gguf_permutes_qk=False,
        qkv_bias=False,
        hf_text_config=gemma3_checkpoint.hf_text_config,
        hf_fields=gemma3_checkpoint.hf_config_fields,
        gguf_options=gemma3_checkpoint.gguf_options,
        default_chat_template=gemma3_checkpoint.CHAT_TEMPLATE,
    ),
    Architecture(
        name="deepseek_v3",
        hf_names=("DeepseekV3ForCausalLM", "deepseek_v3"),
        family=deepseek_v3.DeepseekV3ForCausalLM,
        gguf_global_names={},
        gguf_layer_names={},
        gguf_permutes_qk=False,
        qkv_bias=False,
        hf_fields=deepseek_v3.hf_config_fields,
        default_chat_template=deepseek_chat.CHAT_TEMPLATE,
        default_tokenizer=deepseek_chat.tokenizer_dir,
        hf_packed_linears=True,
    ),
    Architecture(
        name="deepseek_v4",
        hf_names=("DeepseekV4ForCausalLM", "deepseek_v4"),
        family=deepseek_v4.DeepseekV4ForCausalLM,
        gguf_global_names={},
        gguf_layer_names={},
        gguf_permutes_qk=False,
        qkv_bias=False,
        hf_fields=deepseek_v4_checkpoint.hf_config_fields,
        hf_text_config=deepseek_v4_checkpoint.hf_text_config,
        hf_tensor_name=deepseek_v4_checkpoint.hf_tensor_name,
        default_chat_template=deepseek_chat.CHAT_TEMPLATE,
        default_tokenizer=deepseek_chat.tokenizer_dir,
        hf_packed_linears=True,
    ),
)

_BY_NAME = {a.name: a for a in ARCHITECTURES}
# Only architectures whose GGUF tensor names we map load from GGUF files.
_BY_GGUF_NAME = {a.name: a for a in ARCHITECTURES if a.gguf_layer_names}
_BY_HF_NAME = {n: a for a in ARCHITECTURES for n in a.hf_names}


def _unsupported(name: str, known: Mapping[str, Architecture], where: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"{where}unsupported architecture {name!r}; supported: {', '.join(known)}")


def gguf_architecture(name: str, where: str = "") -> Architecture:
    """The architecture of a GGUF ``general.architecture`` value; ``where`` prefixes the error."""
    found = _BY_GGUF_NAME.get(name)
    if found is None:
        raise _unsupported(name, _BY_GGUF_NAME, where)
    return found


def hf_architecture(name: str, where: str = "") -> Architecture:
    """The architecture of an HF ``architectures`` entry (or ``model_type``); ``where`` prefixes the error."""
    found = _BY_HF_NAME.get(name)
    if found is None:
        raise _unsupported(name, _BY_HF_NAME, where)
    return found


def architecture(name: str) -> Architecture:
    """The architecture whose :attr:`Architecture.name` is ``name`` (a :class:`ModelConfig`'s)."""
    found = _BY_NAME.get(name)
    if found is None:
        raise _unsupported(name, _BY_NAME, "")
    return found


def build_model(
    config: ModelConfig,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
    kernels: Kernels | None = None,
) -> CausalLM:
    """An empty model of ``config``'s family over ``kernels`` (default: the torch path)."""
    return architecture(config.architecture).family(config, device=device, dtype=dtype, kernels=kernels)
