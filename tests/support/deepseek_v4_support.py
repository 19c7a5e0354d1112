"""Tiny random DeepSeek V4 checkpoints saved with transformers (the oracle), and a direct loader for them."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

#: Every attention kind and both routings: heavy, sparse, sliding-only, sparse, heavy; two hash layers.
LAYER_TYPES = [
    "heavily_compressed_attention",
    "compressed_sparse_attention",
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
]
MLP_TYPES = ["hash_moe", "hash_moe", "moe", "moe", "moe"]
COMPRESS_YARN = {
    "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
}  # fmt: skip


def tiny_config(*, yarn: bool = False, **overrides: Any) -> Any:
    """A 5-layer DeepseekV4Config of 8 experts: CSA (rate 4, top-3 indexer) and HCA (rate 8) layers,
    a sliding-only layer, an 8-token window, and a low ``swiglu_limit`` that clamps."""
    import transformers

    kw: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
        head_dim=32, partial_rotary_factor=0.25, q_lora_rank=48, num_experts_per_tok=2, n_routed_experts=8,
        layer_types=list(LAYER_TYPES), mlp_layer_types=list(MLP_TYPES),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3,
        hc_mult=4, hc_sinkhorn_iters=20, swiglu_limit=1.5, routed_scaling_factor=1.5,
        num_nextn_predict_layers=0, max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=0, bos_token_id=1,
    )  # fmt: skip
    if yarn:
        kw["rope_parameters"] = dict(COMPRESS_YARN)
    kw.update(overrides)
    return transformers.DeepseekV4Config(**kw)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale activations (transformers' 0.02 init makes every logit nearly equal), norms and
    mixing scales near one, a correction bias that changes the chosen experts, and a hash table
    routing each token to distinct experts."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                experts = int(model.config.n_routed_experts)
                order = torch.rand(p.shape[0], experts, generator=gen).argsort(dim=-1)
                p.copy_(order[:, : p.shape[1]])
                continue
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.2 * noise)
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def save_tiny(directory: Path, seed: int = 0, **config: Any) -> Any:
    """Save a randomized tiny V4 model to ``directory``; returns the transformers model (eval, float32)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(tiny_config(**config)).eval()
    randomize(model, seed)
    model.save_pretrained(directory)
    return model
