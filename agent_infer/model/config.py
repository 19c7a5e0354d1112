"""Architecture hyper-parameters shared by the GGUF and Hugging Face loaders."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from agent_infer.errors import UnsupportedModelError

_SUPPORTED_ROPE_SCALING = ("llama3", "linear")
#: The keys each ``rope_scaling`` type needs (HF's own defaults are not ours to guess).
_ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class MoESettings:
    """A mixture-of-experts feed-forward in every block: ``num_experts`` SwiGLU experts of width
    ``intermediate_size``, ``top_k`` per token by softmax score, renormalized when ``norm_topk_prob``."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]"
            )


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
    #: Each query attends to at most this many keys, its own included (Mistral); None: all before it.
    sliding_window: int | None = None
    #: Per-pair RoPE frequency divisors (llama.cpp's ``rope_freqs`` tensor: Llama 3.1+ GGUFs).
    rope_freq_factors: tuple[float, ...] | None = None
    #: The experts of a mixture-of-experts family (Qwen 3 MoE); None: dense.
    moe: MoESettings | None = None

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
            missing = [k for k in _ROPE_SCALING_KEYS.get(kind, ()) if k not in self.rope_scaling]
            if missing:
                raise UnsupportedModelError(f"rope_scaling of type {kind!r} lacks {', '.join(missing)}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UnsupportedModelError(f"sliding_window={self.sliding_window} must be >= 1")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise UnsupportedModelError(
                f"rope_freq_factors has {len(self.rope_freq_factors)} entries for head_dim {self.head_dim}"
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
    """Per-pair inverse frequencies (float32, computed the way HF does), with ``rope_scaling`` and
    ``rope_freq_factors`` applied."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_freq_factors is not None:
        # llama.cpp: theta_i = pos * base^(-2i/d) / freq_factors[i]
        inv = inv / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    scaling = config.rope_scaling
    kind = "default" if scaling is None else rope_scaling_type(scaling)
    if scaling is None or kind == "default":
        return inv
    factor = float(scaling.get("factor", 1.0))
    if kind == "linear":
        return inv / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_ctx / low, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
    return torch.where(medium, smoothed, scaled)
