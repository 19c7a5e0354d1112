"""Architecture hyper-parameters shared by the GGUF and Hugging Face loaders."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from agent_infer.errors import UnsupportedModelError

_SUPPORTED_ROPE_SCALING = ("llama3", "linear")


@dataclass(frozen=True)
class ModelConfig:
    """Everything the forward pass needs to know about a decoder; ``architecture`` is a name of the
    registry (:mod:`agent_infer.model.registry`), which picks the family."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=True)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    #: Keys a sliding-window layer attends to: positions ``p - sliding_window < k <= p``.
    sliding_window: int | None = None
    #: Per layer, ``"sliding_attention"`` or ``"full_attention"`` (HF's ``layer_types``); empty: all full.
    layer_types: tuple[str, ...] = ()
    #: RoPE base of the sliding-window layers (Gemma 3's ``rope_local_base_freq``); None: ``rope_theta``.
    rope_local_theta: float | None = None
    #: Attention scores are scaled by ``query_pre_attn_scalar ** -0.5``; None: ``head_dim ** -0.5``.
    query_pre_attn_scalar: float | None = None
    #: Final logits become ``cap * tanh(logits / cap)``; None: no capping.
    final_logit_softcapping: float | None = None
    #: The gated MLP's activation: ``"silu"`` (SwiGLU) or ``"gelu_pytorch_tanh"`` (GeGLU).
    hidden_activation: str = "silu"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.rope_scaling is not None:
            kind = rope_scaling_type(self.rope_scaling)
            if kind not in _SUPPORTED_ROPE_SCALING and kind != "default":
                raise UnsupportedModelError(
                    f"unsupported rope_scaling type {kind!r}; supported: {', '.join(_SUPPORTED_ROPE_SCALING)}"
                )

    @property
    def q_size(self) -> int:
        """Width of the query projection output."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projection outputs."""
        return self.num_kv_heads * self.head_dim


def rope_scaling_type(scaling: dict[str, Any]) -> str:
    """The scaling kind of an HF ``rope_scaling`` dict (HF has used both ``type`` and ``rope_type``)."""
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies (float32, computed the way HF does), with ``rope_scaling`` applied."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    kind = "default" if scaling is None else rope_scaling_type(scaling)
    if scaling is None or kind == "default":
        return inv
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)
