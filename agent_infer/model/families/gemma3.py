"""The Gemma 3 family (text decoder), on shared layers.

A decoder block is RMSNorm -> fused q/k/v projection -> per-head RMSNorm on q and k -> RoPE ->
paged GQA attention (scores scaled by ``query_pre_attn_scalar ** -0.5``) -> o projection ->
RMSNorm, added to the residual; then RMSNorm -> GeGLU MLP -> RMSNorm, added to the residual.
Layers alternate between sliding-window attention (keys within ``sliding_window`` positions, RoPE
base ``rope_local_theta``) and global attention (``rope_theta`` with its scaling); the paged cache
keeps every key and the sliding layers mask the old ones. Embeddings are scaled by
``sqrt(hidden_size)`` and tied to the LM head; logits may be soft-capped.

Gemma's RMSNorm multiplies by ``1 + weight``. The norms here hold the multiplier itself (the form
llama.cpp's converter writes to GGUF), so a Hugging Face checkpoint's norm weights get 1 added at
load time (:meth:`Gemma3ForCausalLM.hf_tensor`) and the fused norm-projection kernels serve both.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from agent_infer.errors import UnsupportedModelError
from agent_infer.model.config import ModelConfig
from agent_infer.model.families.base import CausalLM, Targets, model_kernels
from agent_infer.model.families.gemma3_checkpoint import FULL, SLIDING
from agent_infer.model.kv_cache import KVCache
from agent_infer.model.layers.attention import AttentionMetadata, AttentionPlan, PagedAttention
from agent_infer.model.layers.kernels import Kernels
from agent_infer.model.layers.linear import Linear, WeightPart
from agent_infer.model.layers.mlp import GatedMLP
from agent_infer.model.layers.norm import RMSNorm
from agent_infer.model.layers.rotary import Rotation

# multimodal checkpoints (Gemma3ForConditionalGeneration) store the text decoder under a prefix
_WRAPPED_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


class Gemma3DecoderLayer(nn.Module):
    """One decoder block (HF names under ``model.layers.{index}.``)."""

    def __init__(
        self,
        config: ModelConfig,
        index: int,
        kernels: Kernels,
        device: torch.device | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        c = config
        p = f"model.layers.{index}."
        self.sliding = c.layer_types[index] == SLIDING
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.post_attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.pre_ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.post_ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, device, dtype)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, device, dtype)
        self.qkv: Linear = kernels.linears.linear(
            [
                WeightPart(p + "self_attn.q_proj.weight", c.q_size),
                WeightPart(p + "self_attn.k_proj.weight", c.kv_size),
                WeightPart(p + "self_attn.v_proj.weight", c.kv_size),
            ],
            c.hidden_size,
        )
        self.o: Linear = kernels.linears.linear(
            [WeightPart(p + "self_attn.o_proj.weight", c.hidden_size)], c.q_size
        )
        self.mlp = GatedMLP(
            kernels.linears, p + "mlp.", c.hidden_size, c.intermediate_size, c.hidden_activation
        )
        self.attention: PagedAttention = kernels.attention
        self.heads, self.kv_heads, self.dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.scale = (c.query_pre_attn_scalar or c.head_dim) ** -0.5

    def norms(self) -> dict[str, RMSNorm]:
        """The block's norms by HF name (under the block's prefix)."""
        return {
            "input_layernorm.weight": self.input_norm,
            "post_attention_layernorm.weight": self.post_attn_norm,
            "pre_feedforward_layernorm.weight": self.pre_ffn_norm,
            "post_feedforward_layernorm.weight": self.post_ffn_norm,
            "self_attn.q_norm.weight": self.q_norm,
            "self_attn.k_norm.weight": self.k_norm,
        }

    def forward(
        self,
        x: torch.Tensor,
        rotation: Rotation,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: AttentionPlan,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The block applied to ``x`` ``[rows, hidden]``; with ``keep``, only those rows go on past attention."""
        rows, heads, dim = int(x.shape[0]), self.heads, self.dim
        q_end, k_end = heads * dim, (heads + self.kv_heads) * dim
        qkv = self.qkv.project_normed(x, self.input_norm)
        # QK norm before RoPE, written back into the fused rows the rotation works on
        qkv[:, :q_end] = self.q_norm.forward(qkv[:, :q_end].view(rows, heads, dim)).view(rows, q_end)
        qkv[:, q_end:k_end] = self.k_norm.forward(qkv[:, q_end:k_end].view(rows, self.kv_heads, dim)).view(
            rows, k_end - q_end
        )
        qk = rotation.apply(qkv, heads + self.kv_heads, dim)
        v = qkv[:, k_end:].view(rows, self.kv_heads, dim)
        attn = self.attention(qk[:, :heads], qk[:, heads:], v, k_cache, v_cache, plan, self.scale)
        if keep is not None:
            x, attn = x.index_select(0, keep), attn.index_select(0, keep)
        x = x + self.post_attn_norm.forward(self.o.project(attn))
        return x + self.post_ffn_norm.forward(self.mlp.forward(x, self.pre_ffn_norm))


class Gemma3ForCausalLM(CausalLM[Gemma3DecoderLayer]):
    """Gemma 3 text causal LM over a paged :class:`KVCache`."""

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        kernels: Kernels | None = None,
    ) -> None:
        """``kernels`` defaults to the torch path on ``device``/``dtype``; the native path needs float32 on the CPU."""
        super().__init__()
        kernels = model_kernels(kernels, device, dtype)
        c = config
        if len(c.layer_types) != c.num_layers or set(c.layer_types) - {SLIDING, FULL}:
            raise UnsupportedModelError(
                f"Gemma 3 needs one of {SLIDING!r}/{FULL!r} per layer, got {c.layer_types}"
            )
        if SLIDING in c.layer_types and not c.sliding_window:
            raise UnsupportedModelError("Gemma 3 sliding-window layers need a sliding_window")
        self.config = c
        self.dtype = dtype
        self.kernels = kernels
        self.embed = nn.Parameter(
            torch.empty(c.vocab_size, c.hidden_size, device=device, dtype=dtype), requires_grad=False
        )
        # HF rounds sqrt(hidden) to the model's dtype before scaling
        self.embed_scale = torch.tensor(math.sqrt(c.hidden_size), dtype=dtype).item()
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(c, i, kernels, device, dtype) for i in range(c.num_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.lm_head: Linear = kernels.linears.head(
            "lm_head.weight", c.vocab_size, c.hidden_size, tied=self.embed if c.tie_word_embeddings else None
        )
        self.rotary = kernels.rotary(c, device, dtype)
        local = dataclasses.replace(c, rope_theta=c.rope_local_theta or c.rope_theta, rope_scaling=None)
        self.local_rotary = kernels.rotary(local, device, dtype)
        self.attention = kernels.attention

    @staticmethod
    def hf_tensor(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """Gemma's ``(1 + weight)`` norms as the multiplier the norms here hold; a multimodal
        checkpoint's text decoder under its causal-LM names, its vision tower dropped."""
        for prefix, renamed in _WRAPPED_PREFIXES:
            if name.startswith(prefix):
                name = renamed + name[len(prefix) :]
                break
        else:
            if name.startswith(_VISION_PREFIXES):
                return None
        return name, (tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)

    def decoder_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        keep_rows: Sequence[int] | None,
    ) -> torch.Tensor:
        """The decoder over K/V caches: sliding layers on their window and local rotary, global ones
        on the whole context; ``keep_rows`` as in :meth:`LlamaForCausalLM.decoder_forward`."""
        c = self.config
        n = int(input_ids.shape[0])
        plan = self.attention.plan(meta, n, kv_cache.num_slots, self.device)
        local_plan = self.attention.plan(meta, n, kv_cache.num_slots, self.device, c.sliding_window)
        ids, pos = self.padded_inputs(input_ids, positions)
        rotation, local_rotation = self.rotary.at(pos), self.local_rotary.at(pos)
        x = F.embedding(ids, self.embed) * self.embed_scale
        keep = None
        if keep_rows is not None and self.kernels.rows_independent and len(keep_rows) < n:
            keep = torch.tensor(list(keep_rows), dtype=torch.int64, device=x.device)
        blocks = self.blocks()
        last = len(blocks) - 1
        for i, layer in enumerate(blocks):
            k_cache, v_cache = kv_cache.flat(i)
            if layer.sliding:
                x = layer.forward(
                    x, local_rotation, k_cache, v_cache, local_plan, keep if i == last else None
                )
            else:
                x = layer.forward(x, rotation, k_cache, v_cache, plan, keep if i == last else None)
        x = self.norm.forward(x)
        if keep is not None:
            return x
        return self.select_rows(x, n, keep_rows)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits ``[M, vocab]`` (soft-capped when configured; masked-out tokens stay ``-inf``)."""
        logits = super().compute_logits(hidden, allowed)
        cap = self.config.final_logit_softcapping
        if cap is None:
            return logits
        return torch.where(torch.isneginf(logits), logits, torch.tanh(logits / cap) * cap)

    def weight_targets(self) -> Targets:
        """HF names of the embedding, the norms and every projection's tensors still loaded by name."""
        t: Targets = {
            "model.embed_tokens.weight": (self.embed, 0, tuple(self.embed.shape)),
            "model.norm.weight": (self.norm.weight, 0, tuple(self.norm.weight.shape)),
        }
        t.update(self.lm_head.load_targets())
        for i, layer in enumerate(self.blocks()):
            p = f"model.layers.{i}."
            for name, norm in layer.norms().items():
                t[p + name] = (norm.weight, 0, tuple(norm.weight.shape))
            for linear in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down):
                t.update(linear.load_targets())
        return t

    def ignored_weight_names(self) -> frozenset[str]:
        """A torch head tied to the embedding: some checkpoints still store the (identical) head."""
        if self.config.tie_word_embeddings and "lm_head.weight" not in self.packed_weight_names():
            return frozenset({"lm_head.weight"})
        return frozenset()
