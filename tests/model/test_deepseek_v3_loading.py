"""Loading DeepSeek V3 folders: block-FP8 checkpoints, MTP layers, and the errors that name what is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from deepseek_quant_support import write_fp8
from deepseek_support import edit_tensors, load_ours, rewrite_config, save_tiny
from safetensors.torch import load_file, save_file

from agent_infer.errors import ModelLoadError
from agent_infer.model.loading.fp8 import dequantize_block_fp8
from agent_infer.model.runner import SequenceRunner

pytest.importorskip("transformers")

BLOCK = (16, 32)  # non-square and not dividing every dimension: partial edge blocks are exercised


def _is_quantized(name: str) -> bool:
    """The tensors DeepSeek stores in FP8: projections and experts, not embeddings, head, norms or router."""
    return name.endswith("proj.weight") or name.endswith("kv_a_proj_with_mqa.weight")


def test_fp8_checkpoint_loads_to_its_dequantized_twin(tmp_path: Path) -> None:
    save_tiny(tmp_path / "f32")
    _, twin = write_fp8(tmp_path / "f32", tmp_path / "fp8", BLOCK, _is_quantized)
    expected = load_file(twin / "model.safetensors")
    fp8 = load_ours(tmp_path / "fp8")
    targets = fp8.weight_targets()
    name = "model.layers.1.self_attn.q_b_proj.weight"  # [96, 48]: 48 = one full and one half block column
    dest, off, shape = targets[name]
    assert torch.equal(dest[off : off + shape[0]], expected[name])
    dest, off, shape = targets["model.layers.2.mlp.experts.5.up_proj.weight"]
    assert torch.equal(dest[off : off + shape[0]], expected["model.layers.2.mlp.experts.5.up_proj.weight"])
    # the dequantized twin as a plain float32 checkpoint gives bit-identical logits
    prompt = list(range(3, 40))
    got = SequenceRunner(fp8, num_blocks=8, block_size=8).step([(0, prompt)])
    want = SequenceRunner(load_ours(twin), num_blocks=8, block_size=8).step([(0, prompt)])
    assert torch.equal(got, want)
    # and the FP8 rounding is visible against the original float weights (so the check above has teeth)
    orig = SequenceRunner(load_ours(tmp_path / "f32"), num_blocks=8, block_size=8).step([(0, prompt)])
    assert not torch.equal(got, orig)


def test_fp8_errors_name_the_tensor() -> None:
    w = torch.randn(40, 70).to(torch.float8_e4m3fn)
    with pytest.raises(ModelLoadError, match=r"'x\.weight_scale_inv' has shape \(2, 2\), expected \(3, 3\)"):
        dequantize_block_fp8("x.weight", w, torch.ones(2, 2), (16, 32))
    assert dequantize_block_fp8("x.weight", w, torch.full((3, 3), 2.0), (16, 32)).equal(w.float() * 2)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"scoring_func": "softmax"}, "unsupported scoring_func 'softmax'"),
        ({"topk_method": "greedy"}, "unsupported topk_method 'greedy'"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"n_group": 3}, "n_routed_experts=8 does not split into n_group=3"),
        ({"topk_group": 5}, "topk_group=5 exceeds n_group=4"),
        ({"kv_lora_rank": None}, "kv_lora_rank must be an integer"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_scaling type 'dynamic'"),
        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method 'gptq'"),
        ({"kv_lora_rank": 24}, r"'model\.layers\.0\.self_attn\.kv_a_layernorm\.weight' has shape \(32,\), expected \(24,\)"),
        ({"moe_layer_freq": 2}, r"unexpected tensor 'model\.layers\.1\.mlp\.experts\.0\.down_proj\.weight'"),
        ({"first_k_dense_replace": 2}, r"unexpected tensor 'model\.layers\.1\.mlp\.experts\.0\.down_proj\.weight'"),
    ],
)  # fmt: skip
def test_config_errors_name_the_key(tmp_path: Path, changes: dict[str, Any], message: str) -> None:
    save_tiny(tmp_path)
    rewrite_config(tmp_path, **changes)
    with pytest.raises(ModelLoadError, match=message):
        load_ours(tmp_path)


def test_tensor_errors_name_the_tensor(tmp_path: Path) -> None:
    save_tiny(tmp_path)
    original = load_file(tmp_path / "model.safetensors")
    edit_tensors(tmp_path, lambda t: t.pop("model.layers.2.mlp.experts.7.down_proj.weight"))
    with pytest.raises(
        ModelLoadError, match=r"missing tensors: model\.layers\.2\.mlp\.experts\.7\.down_proj\.weight"
    ):
        load_ours(tmp_path)
    save_file(
        {**original, "model.layers.0.self_attn.q_proj.weight": torch.zeros(96, 64)},
        tmp_path / "model.safetensors",
    )
    with pytest.raises(
        ModelLoadError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.weight'"
    ):
        load_ours(tmp_path)
    save_file(
        {**original, "model.layers.1.mlp.gate.weight": torch.zeros(8, 63)}, tmp_path / "model.safetensors"
    )
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.1\.mlp\.gate\.weight' has shape \(8, 63\)"):
        load_ours(tmp_path)


def test_mtp_layers_are_accepted_only_when_declared(tmp_path: Path) -> None:
    save_tiny(tmp_path)
    mtp = "model.layers.3."  # num_hidden_layers = 3: DeepSeek's name of the first NextN layer
    extra = {
        mtp + "enorm.weight": torch.ones(64), mtp + "hnorm.weight": torch.ones(64),
        mtp + "eh_proj.weight": torch.zeros(64, 128), mtp + "shared_head.norm.weight": torch.ones(64),
        mtp + "self_attn.kv_b_proj.weight": torch.zeros(96, 32),
    }  # fmt: skip
    edit_tensors(tmp_path, lambda t: t.update(extra))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.3\."):
        load_ours(tmp_path)
    rewrite_config(tmp_path, num_nextn_predict_layers=1)
    # Declared, the layer is loaded: a partial or mis-shaped set is named (test_mtp.py loads full ones).
    with pytest.raises(ModelLoadError, match=r"model\.layers\.3\."):
        load_ours(tmp_path)
