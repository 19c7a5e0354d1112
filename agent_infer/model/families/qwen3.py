"""The Qwen 3 family: the Llama block with an RMSNorm over each head of q and k before RoPE.

Qwen 3 has no q/k/v biases, a ``head_dim`` set on its own (not ``hidden_size / heads``), and a
tied or untied head; everything but the QK norm is :mod:`.llama`'s. llama.cpp stores Qwen q/k rows
in HF order (no permutation) and the norms as ``attn_q_norm``/``attn_k_norm``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agent_infer.model.config import ModelConfig
from agent_infer.model.families.llama import GGUF_LAYER_NAMES as LLAMA_LAYER_NAMES
from agent_infer.model.families.llama import LlamaDecoderLayer, LlamaForCausalLM
from agent_infer.model.layers.kernels import Kernels
from agent_infer.model.layers.norm import RMSNorm
from agent_infer.model.layers.rotary import Rotation

GGUF_LAYER_NAMES = {
    **LLAMA_LAYER_NAMES,
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """A Llama block whose q and k heads are RMS-normalized (weights ``[head_dim]``) before RoPE."""

    def __init__(
        self,
        config: ModelConfig,
        index: int,
        kernels: Kernels,
        device: torch.device | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__(config, index, kernels, device, dtype)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, device, dtype)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, device, dtype)

    def rotate_qk(self, qkv: torch.Tensor, rotation: Rotation) -> torch.Tensor:
        """q and k heads normalized per head, then rotated, as ``[rows, heads + kv_heads, dim]``."""
        rows, heads, kv_heads, dim = int(qkv.shape[0]), self.heads, self.kv_heads, self.dim
        q = qkv[:, : heads * dim].view(rows, heads, dim)
        k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
        q = F.rms_norm(q, (dim,), self.q_norm.weight, self.q_norm.eps)
        k = F.rms_norm(k, (dim,), self.k_norm.weight, self.k_norm.eps)
        # one contiguous [rows, (heads + kv_heads) * dim] block: what either rotation rotates in place or copies
        qk = torch.cat((q, k), dim=1).view(rows, (heads + kv_heads) * dim)
        return rotation.apply(qk, heads + kv_heads, dim)

    def norms(self) -> dict[str, RMSNorm]:
        """The Llama block's norms and the per-head q/k norms."""
        return {**super().norms(), "self_attn.q_norm": self.q_norm, "self_attn.k_norm": self.k_norm}


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen 3 dense causal LM (``Qwen3ForCausalLM``, GGUF ``qwen3``) over a paged KV cache."""

    layer_class = Qwen3DecoderLayer
