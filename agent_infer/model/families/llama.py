"""The Llama family: Llama 2/3.x, Mistral (Llama with a sliding window) and Qwen2 (Llama with q/k/v
biases), on shared layers.

A decoder block is RMSNorm -> fused q/k/v projection (optional bias) -> RoPE -> paged GQA
attention (optionally over a sliding window) -> o projection, then RMSNorm -> SwiGLU MLP, each with
a residual; embeddings may be tied to the LM head. q/k/v and gate/up are fused into single
projections to halve the calls. Families that change only how q/k are prepared (Qwen 3's QK norm)
subclass the block and override :meth:`LlamaDecoderLayer.rotate_qk`.

Rows of a forward are padded as the loader's :class:`Kernels` asks; attention runs per sequence
and every other op is row-wise, so a sequence's logits do not depend on its batch (see
layers/linear.py for the torch path, layers/qlinear.py for the native one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from agent_infer.errors import UnsupportedModelError
from agent_infer.model.config import ModelConfig
from agent_infer.model.families.base import CausalLM, Targets, model_kernels
from agent_infer.model.kv_cache import KVCache
from agent_infer.model.layers.attention import AttentionMetadata, AttentionPlan, PagedAttention
from agent_infer.model.layers.kernels import Kernels
from agent_infer.model.layers.linear import Linear, WeightPart
from agent_infer.model.layers.mlp import FeedForward, GatedMLP
from agent_infer.model.layers.norm import RMSNorm
from agent_infer.model.layers.rotary import Rotation

#: llama.cpp's GGUF tensor names -> HF names: outside the blocks, then per block (``blk.N.``).
GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


class LlamaDecoderLayer(nn.Module):
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
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.qkv: Linear = kernels.linears.linear(
            [
                WeightPart(p + "self_attn.q_proj.weight", c.q_size, rope_heads=c.num_heads),
                WeightPart(p + "self_attn.k_proj.weight", c.kv_size, rope_heads=c.num_kv_heads),
                WeightPart(p + "self_attn.v_proj.weight", c.kv_size),
            ],
            c.hidden_size,
            bias=c.attention_bias,
        )
        self.o: Linear = kernels.linears.linear(
            [WeightPart(p + "self_attn.o_proj.weight", c.hidden_size)], c.q_size
        )
        self.mlp = self.make_mlp(c, p + "mlp.", kernels, device, dtype)
        self.attention: PagedAttention = kernels.attention
        self.heads, self.kv_heads, self.dim = c.num_heads, c.num_kv_heads, c.head_dim
        #: The attention plan this block takes (one per distinct window in a forward).
        self.sliding_window = c.sliding_window

    def make_mlp(
        self,
        config: ModelConfig,
        prefix: str,
        kernels: Kernels,
        device: torch.device | None,
        dtype: torch.dtype,
    ) -> FeedForward:
        """The block's feed-forward (HF names under ``prefix``): a dense SwiGLU MLP here."""
        if config.moe is not None:
            raise UnsupportedModelError(
                f"{config.architecture} models with experts (expert_count / num_experts) are not supported"
            )
        return GatedMLP(kernels.linears, prefix, config.hidden_size, config.intermediate_size)

    def rotate_qk(self, qkv: torch.Tensor, rotation: Rotation) -> torch.Tensor:
        """q and k heads of the fused ``qkv`` rows, rotated, as ``[rows, heads + kv_heads, dim]``."""
        return rotation.apply(qkv, self.heads + self.kv_heads, self.dim)

    def norms(self) -> dict[str, RMSNorm]:
        """The block's norms by HF name suffix (under ``model.layers.{index}.``)."""
        return {"input_layernorm": self.input_norm, "post_attention_layernorm": self.post_norm}

    def forward(
        self,
        x: torch.Tensor,
        rotation: Rotation,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: AttentionPlan,
        keep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The block applied to ``x`` ``[rows, hidden]``; with ``keep`` (row indices), only those rows
        go on past attention (the others only needed their K/V cached)."""
        rows, heads, qk_heads, dim = int(x.shape[0]), self.heads, self.heads + self.kv_heads, self.dim
        qkv = self.qkv.project_normed(x, self.input_norm)
        qk = self.rotate_qk(qkv, rotation)
        v = qkv[:, qk_heads * dim :].view(rows, self.kv_heads, dim)
        attn = self.attention(qk[:, :heads], qk[:, heads:], v, k_cache, v_cache, plan)
        if keep is not None:
            x, attn = x.index_select(0, keep), attn.index_select(0, keep)
        x = x + self.o.project(attn)
        # called directly: module dispatch costs microseconds, paid ~30 times per step
        return x + self.mlp.forward(x, self.post_norm)


class LlamaForCausalLM(CausalLM[LlamaDecoderLayer]):
    """Llama-architecture causal LM (Qwen2 = Llama + q/k/v bias) over a paged :class:`KVCache`."""

    #: The decoder block; a family that differs only inside the block subclasses both.
    layer_class: ClassVar[type[LlamaDecoderLayer]] = LlamaDecoderLayer

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
        self.config = c
        self.dtype = dtype
        self.kernels = kernels
        self.embed = nn.Parameter(
            torch.empty(c.vocab_size, c.hidden_size, device=device, dtype=dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(
            self.layer_class(c, i, kernels, device, dtype) for i in range(c.num_layers)
        )
        self._windows = tuple(dict.fromkeys(layer.sliding_window for layer in self.blocks()))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.lm_head: Linear = kernels.linears.head(
            "lm_head.weight", c.vocab_size, c.hidden_size, tied=self.embed if c.tie_word_embeddings else None
        )
        self.rotary = kernels.rotary(c, device, dtype)
        self.attention = kernels.attention

    def decoder_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        keep_rows: Sequence[int] | None,
    ) -> torch.Tensor:
        """The decoder over K/V caches. With ``keep_rows``, when the kernels' rows are independent of
        the row count, the last layer runs its output projection and MLP for those rows alone (the
        other rows only need their K/V there), which leaves the kept rows' bits unchanged."""
        n = int(input_ids.shape[0])
        plans = {w: self.attention.plan(meta, n, kv_cache.num_slots, self.device, w) for w in self._windows}
        ids, pos = self.padded_inputs(input_ids, positions)
        rotation = self.rotary.at(pos)
        x = F.embedding(ids, self.embed)
        keep = None
        if keep_rows is not None and self.kernels.rows_independent and len(keep_rows) < n:
            keep = torch.tensor(list(keep_rows), dtype=torch.int64, device=x.device)
        blocks = self.blocks()
        last = len(blocks) - 1
        for i, layer in enumerate(blocks):
            k_cache, v_cache = kv_cache.flat(i)
            plan = plans[layer.sliding_window]
            x = layer.forward(x, rotation, k_cache, v_cache, plan, keep if i == last else None)
        x = self.norm.forward(x)
        if keep is not None:
            return x
        return self.select_rows(x, n, keep_rows)

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
                t[f"{p}{name}.weight"] = (norm.weight, 0, tuple(norm.weight.shape))
            for linear in (layer.qkv, layer.o):
                t.update(linear.load_targets())
            t.update(layer.mlp.load_targets())
        return t

    def ignored_weight_names(self) -> frozenset[str]:
        """A torch head tied to the embedding: some checkpoints still store the (identical) head."""
        if self.config.tie_word_embeddings and "lm_head.weight" not in self.packed_weight_names():
            return frozenset({"lm_head.weight"})
        return frozenset()
