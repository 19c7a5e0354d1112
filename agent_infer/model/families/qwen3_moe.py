"""The Qwen 3 MoE family: the Qwen 3 block with a mixture of experts in place of its dense MLP.

Every block routes each token to ``top_k`` of ``num_experts`` SwiGLU experts by softmax score
(renormalized when ``norm_topk_prob``), over :class:`~agent_infer.model.layers.moe.MoE`. The
experts are torch tensors on both load paths (the native path packs attention and the head).
Hugging Face checkpoints store one tensor per expert (``mlp.experts.{e}.gate_proj.weight``);
llama.cpp stacks them (``ffn_gate_exps`` ``[E, I, H]``), which the GGUF loader splits back by
:data:`GGUF_EXPERT_NAMES`.
"""

from __future__ import annotations

import torch
from torch import nn

from agent_infer.errors import UnsupportedModelError
from agent_infer.model.config import ModelConfig
from agent_infer.model.families.qwen3 import GGUF_LAYER_NAMES as QWEN3_LAYER_NAMES
from agent_infer.model.families.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM
from agent_infer.model.layers.kernels import Kernels
from agent_infer.model.layers.mlp import FeedForward
from agent_infer.model.layers.moe import MoE
from agent_infer.model.layers.norm import RMSNorm

GGUF_LAYER_NAMES = {
    **{k: v for k, v in QWEN3_LAYER_NAMES.items() if not k.startswith("ffn_") or k == "ffn_norm.weight"},
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
#: Stacked GGUF expert tensors -> the HF name of expert ``{e}``'s slice (per block).
GGUF_EXPERT_NAMES = {
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
}


class SparseMoeBlock(nn.Module):
    """The MoE feed-forward of one block, loaded from per-expert HF tensors under ``prefix``."""

    def __init__(
        self, config: ModelConfig, prefix: str, device: torch.device | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        moe = config.moe
        if moe is None:
            raise UnsupportedModelError(f"a {config.architecture} model needs its num_experts settings")
        self.prefix = prefix
        self.moe = MoE(
            config.hidden_size,
            moe.intermediate_size,
            moe.num_experts,
            moe.top_k,
            scoring="softmax",
            renormalize=moe.renormalize,
            device=device,
            dtype=dtype,
        )

    def forward(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """The experts' weighted sum for ``norm(x)``."""
        return self.moe.forward(norm.forward(x))

    def load_targets(self) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]:
        """The router and each expert's gate, up and down tensors (gate and up fused per expert)."""
        m, p = self.moe, self.prefix
        inter, hidden = m.down.shape[2], m.down.shape[1]
        t: dict[str, tuple[torch.Tensor, int, tuple[int, ...]]] = {
            p + "gate.weight": (m.router, 0, tuple(m.router.shape))
        }
        for e in range(m.num_experts):
            t[f"{p}experts.{e}.gate_proj.weight"] = (m.gate_up[e], 0, (inter, hidden))
            t[f"{p}experts.{e}.up_proj.weight"] = (m.gate_up[e], inter, (inter, hidden))
            t[f"{p}experts.{e}.down_proj.weight"] = (m.down[e], 0, (hidden, inter))
        return t


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """A Qwen 3 block whose feed-forward is a :class:`SparseMoeBlock`."""

    def make_mlp(
        self,
        config: ModelConfig,
        prefix: str,
        kernels: Kernels,
        device: torch.device | None,
        dtype: torch.dtype,
    ) -> FeedForward:
        """The block's experts and router."""
        return SparseMoeBlock(config, prefix, device, dtype)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen 3 MoE causal LM (``Qwen3MoeForCausalLM``, GGUF ``qwen3moe``) over a paged KV cache."""

    layer_class = Qwen3MoeDecoderLayer
