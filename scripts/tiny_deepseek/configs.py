"""The tiny DeepSeek V3 and V4 configurations: a few million parameters, most of them the embedding
of the 129,280-id vocabulary (hidden size 64 keeps two vocabulary matrices under the 20 MB budget in FP8)."""

from __future__ import annotations

from typing import Any

VOCAB = 129_280
HIDDEN = 64
#: Main decoder layers; the MTP module is one more layer after them.
LAYERS = 4
MAX_POSITIONS = 4096


def v3_config() -> Any:
    """A DeepseekV3Config: MLA (q and kv low rank, decoupled RoPE with YaRN), one dense layer, then
    DeepSeekMoE layers of 8 routed experts in 4 groups (top 2 of 2 groups) plus a shared expert."""
    import transformers

    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=160, moe_intermediate_size=48,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16,
        v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2,
        first_k_dense_replace=1, max_position_embeddings=MAX_POSITIONS, num_nextn_predict_layers=1,
        tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
        },
    )  # fmt: skip


def v4_config() -> Any:
    """A DeepseekV4Config: sliding, compressed-sparse (CSA, rate 4) and heavily compressed (HCA, rate
    16) attention layers, hash-routed MoE then top-k MoE of 8 experts, 2 hyper-connection streams."""
    import transformers

    return transformers.DeepseekV4Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, moe_intermediate_size=48, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, partial_rotary_factor=0.5, q_lora_rank=48,
        num_experts_per_tok=2, n_routed_experts=8, n_shared_experts=1, routed_scaling_factor=1.5,
        max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True, bos_token_id=0, eos_token_id=1,
        layer_types=[
            "heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention",
            "compressed_sparse_attention",
        ],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        hc_mult=2, hc_sinkhorn_iters=8, sliding_window=64, o_groups=2, o_lora_rank=32, index_n_heads=2,
        index_head_dim=16, index_topk=16, num_nextn_predict_layers=1, swiglu_limit=10.0,
    )  # fmt: skip


def config(arch: str) -> Any:
    """The configuration of ``arch`` (``v3`` or ``v4``)."""
    return {"v3": v3_config, "v4": v4_config}[arch]()
