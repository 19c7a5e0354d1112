"""YaRN rope scaling: our frequency tables and cos/sin factor against transformers', and a Llama
checkpoint with YaRN end to end."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from agent_infer.model.config import ModelConfig, rope_attention_factor, rope_inv_freq
from agent_infer.model.loading.hf import hf_config, hf_weights
from agent_infer.model.registry import build_model
from agent_infer.model.runner import SequenceRunner

transformers = pytest.importorskip("transformers")

CASES: list[dict[str, Any]] = [
    {"factor": 4.0, "original_max_position_embeddings": 64},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0},
    {
        "factor": 8.0,
        "original_max_position_embeddings": 128,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
    },
    {"factor": 2.0, "original_max_position_embeddings": 256, "truncate": False, "beta_slow": 2},
    {"factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 1.5},
]


@pytest.mark.parametrize("params", CASES)
def test_tables_match_transformers(params: dict[str, Any]) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, **params}
    hf_cfg = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=2, max_position_embeddings=16384, rope_parameters=dict(rope)
    )
    want_inv, want_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, None)
    ours = ModelConfig(
        architecture="llama", vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=2,
        num_kv_heads=2, head_dim=32, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=16384,
        tie_word_embeddings=False, rope_scaling=rope,
    )  # fmt: skip
    assert torch.equal(rope_inv_freq(ours), want_inv)
    assert rope_attention_factor(ours) == pytest.approx(
        want_factor, rel=1e-12
    )  # 1 when mscale == mscale_all_dim


def test_llama_with_yarn_matches_transformers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 64},
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    hf.save_pretrained(tmp_path)
    ours = build_model(hf_config(tmp_path))
    ours.load_weights(hf_weights(tmp_path))
    ids = list(range(3, 200))  # well past original_max_position_embeddings
    got = SequenceRunner(ours, num_blocks=32, block_size=16).step([(0, ids)])[0]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, -1]
    assert want.abs().max().item() > 1.0
    assert (got - want).abs().max().item() <= 1e-4
