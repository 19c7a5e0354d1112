"""Architecture hyper-parameters shared by the GGUF and Hugging Face loaders."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from agent_infer.errors import UnsupportedModelError

_SUPPORTED_ROPE_SCALING = ("llama3", "linear", "yarn")
#: The keys each ``rope_scaling`` type needs (HF's own defaults are not ours to guess).
_ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek V2/V3): low-rank q and kv projections, a decoupled RoPE key.

    ``q_lora_rank`` None means a full-rank q projection. A token's cache entry is the normalized kv
    latent (``kv_lora_rank``) followed by the rotated shared key (``qk_rope_head_dim``).
    """

    kv_lora_rank: int
    q_lora_rank: int | None
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    #: The checkpoint's rope dims come in interleaved pairs ``(x0, x1), (x2, x3)...`` (DeepSeek's layout).
    rope_interleave: bool = True

    @property
    def latent_dim(self) -> int:
        """Values cached per token per layer."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        """Width of one head's query and (expanded) key."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoESpec:
    """Routed experts of a DeepSeekMoE-style decoder: which layers have them and how tokens are routed."""

    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int = 0
    scoring: str = "softmax"
    renormalize: bool = True
    routed_scaling_factor: float = 1.0
    #: A per-expert bias that shifts the choice of experts (DeepSeek V3's ``e_score_correction_bias``).
    score_bias: bool = False
    #: Group-limited routing: experts split in ``num_groups`` groups, tokens choose among ``topk_groups`` of them.
    num_groups: int = 1
    topk_groups: int = 1
    #: Layers below this index are dense; above it every ``layer_freq``-th layer is MoE.
    first_dense_layers: int = 0
    layer_freq: int = 1

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` has routed experts (DeepSeek's rule)."""
        return index >= self.first_dense_layers and index % self.layer_freq == 0

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise UnsupportedModelError(
                f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]"
            )


@dataclass(frozen=True)
class DeepseekV4Spec:
    """DeepSeek V4's attention, hyper-connections and routing (see model/families/deepseek_v4.py).

    Per layer, ``compress_rates[i]`` is 0 for a sliding-window-only layer, else the tokens per
    compressed entry; ``sparse[i]`` marks compressed sparse attention (overlapping windows plus the
    lightning indexer's top-k) as opposed to heavily compressed attention. ``hash_layers[i]`` marks
    MoE layers that route by a fixed token-id table.
    """

    q_lora_rank: int
    qk_rope_head_dim: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_rates: tuple[int, ...]
    sparse: tuple[bool, ...]
    hash_layers: tuple[bool, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    #: RoPE of the compressed layers and their compressors (the sliding-only layers use ``rope_theta``).
    compress_rope_theta: float
    compress_rope_scaling: dict[str, Any] | None = field(default=None, hash=False, compare=True)
    swiglu_limit: float | None = None

    def entry_stride(self, layer: int, block_size: int) -> int:
        """Token slots per compressed-entry slot of ``layer``: ``min(rate, block_size)`` (0: no entries)."""
        rate = self.compress_rates[layer]
        return min(rate, block_size) if rate else 0


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
    #: Set for latent-attention models; the KV cache then stores the latent layout.
    mla: MLASpec | None = None
    #: Routed experts (DeepSeekMoE, Qwen 3 MoE); None: dense.
    moe: MoESpec | None = None
    #: MTP/NextN layers the checkpoint carries after the decoder (``model.layers.{num_layers + i}``).
    num_nextn_layers: int = 0
    #: Each query attends to at most this many keys, its own included (Mistral); None: all before it.
    sliding_window: int | None = None
    #: Per-pair RoPE frequency divisors (llama.cpp's ``rope_freqs`` tensor: Llama 3.1+ GGUFs).
    rope_freq_factors: tuple[float, ...] | None = None
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
    #: Set for DeepSeek V4 (compressed attention, hyper-connections); the KV cache then stores its layout.
    deepseek_v4: DeepseekV4Spec | None = None

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
            missing = [k for k in _ROPE_SCALING_KEYS.get(kind, ()) if self.rope_scaling.get(k) is None]
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
    if kind == "yarn":
        return _yarn_inv_freq(inv, dim, config.rope_theta, scaling)
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


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature ``0.1 * mscale * ln(scale) + 1`` (1 when not scaling up)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_attention_factor(config: ModelConfig) -> float:
    """The factor YaRN applies to cos/sin (1 for every other scaling), as transformers computes it."""
    scaling = config.rope_scaling
    if scaling is None or rope_scaling_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


def _yarn_inv_freq(inv: torch.Tensor, dim: int, base: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN: extrapolated frequencies above the correction band, interpolated ones below, a ramp between."""
    factor = float(scaling["factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + inv * extrapolation
