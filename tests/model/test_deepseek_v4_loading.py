"""Loading DeepSeek V4 folders: block-FP8 checkpoints, MTP layers, cache geometry, and the errors that
name what is wrong."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from deepseek_quant_support import write_fp8
from deepseek_support import edit_tensors, load_ours, rewrite_config, save_tiny_v4
from safetensors.torch import load_file, save_file

from agent_infer.errors import ConfigError, ModelLoadError
from agent_infer.model.kv_cache import KVCache
from agent_infer.model.loading.hf import hf_config
from agent_infer.model.runner import SequenceRunner

pytest.importorskip("transformers")

BLOCK = (16, 32)  # non-square and not dividing every dimension: partial edge blocks are exercised


def _is_quantized(name: str) -> bool:
    """What V4 stores in FP8: the attention and expert projections (not the compressors' value/gate
    projections, norms, router, hyper-connection mixers, embedding or head)."""
    leaf = name.rsplit(".", 2)[-2] if name.endswith(".weight") else ""
    return leaf in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b", "w1", "w2", "w3") and ".compressor." not in name


def test_fp8_checkpoint_loads_to_the_logits_of_its_dequantized_twin(tmp_path: Path) -> None:
    save_tiny_v4(tmp_path / "f32")
    quantized, twin = write_fp8(tmp_path / "f32", tmp_path / "fp8", BLOCK, _is_quantized)
    # per layer: five attention projections and three per expert (8 routed, 1 shared); the indexers' wq_b
    assert quantized == 5 * (5 + 3 * 9) + 2
    fp8, ref = load_ours(tmp_path / "fp8"), load_ours(twin)
    original = load_ours(tmp_path / "f32")
    prompt = torch.randint(2, 256, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = [
        SequenceRunner(m, num_blocks=8, block_size=8).step([(0, prompt)])[0] for m in (fp8, ref, original)
    ]
    assert torch.equal(logits[0], logits[1])
    assert not torch.equal(logits[0], logits[2])  # quantization did change the weights


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, torch.Tensor]]:
    d = tmp_path_factory.mktemp("v4")
    save_tiny_v4(d)
    return (d / "config.json").read_text(), load_file(d / "model.safetensors")


def _copy(saved: tuple[str, dict[str, torch.Tensor]], d: Path) -> Path:
    (d / "config.json").write_text(saved[0])
    save_file(saved[1], d / "model.safetensors")
    return d


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"scoring_func": "relu"}, "unsupported scoring_func 'relu'"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"num_key_value_heads": 2}, "num_key_value_heads must be 1"),
        ({"n_shared_experts": 2}, "n_shared_experts must be 1"),
        ({"layer_types": ["full_attention"] * 5}, r"layer_types\[0\] = 'full_attention'"),
        ({"layer_types": ["sliding_attention"]}, "layer_types must list 5"),
        ({"mlp_layer_types": ["dense"] * 5}, r"mlp_layer_types\[0\] = 'dense'"),
        ({"o_groups": 3}, "o_groups=3 does not divide"),
        ({"qk_rope_head_dim": 34}, "qk_rope_head_dim=34 must be even and at most"),
        ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4},
                              "compress": {"rope_type": "linear", "factor": 2.0}}}, "compressed-layer rope type 'linear'"),
        ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1e4},
                              "compress": {"rope_type": "yarn", "factor": 2.0}}}, "lacks 'original_max_position_embeddings'"),
        ({"quantization_config": {"quant_method": "fp8", "expert_dtype": "int4"}}, "unsupported expert_dtype 'int4'"),
        ({"quantization_config": {"quant_method": "fp8", "scale_fmt": "e5m2"}}, "quantization_config.scale_fmt 'e5m2'"),
        ({"swiglu_limit": -1}, "swiglu_limit must be a positive number"),
        ({"head_dim": 16}, r"'model\.layers\.0\.attn\.compressor\.ape' has shape \(8, 32\), expected \(8, 16\)"),
        ({"mlp_layer_types": ["moe"] * 5}, r"unexpected tensor 'model\.layers\.0\.ffn\.gate\.tid2eid'"),
        ({"layer_types": ["sliding_attention"] * 5}, r"unexpected tensor 'model\.layers\.0\.attn\.compressor\."),
    ],
)  # fmt: skip
def test_config_errors_name_the_key(
    saved: tuple[str, dict[str, torch.Tensor]], tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    d = _copy(saved, tmp_path)
    rewrite_config(d, **changes)
    with pytest.raises(ModelLoadError, match=message):
        load_ours(d)


def test_tensor_errors_name_the_tensor(saved: tuple[str, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    d = _copy(saved, tmp_path)
    original = saved[1]
    edit_tensors(d, lambda t: t.pop("model.layers.1.attn.indexer.compressor.ape"))
    with pytest.raises(
        ModelLoadError, match=r"missing tensors: model\.layers\.1\.attn\.indexer\.compressor\.ape"
    ):
        load_ours(d)
    save_file({**original, "model.layers.2.attn.compressor.ape": torch.zeros(4, 64)}, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.2\.attn\.compressor\.ape'"):
        load_ours(d)
    save_file({**original, "model.layers.4.ffn.gate.weight": torch.zeros(8, 63)}, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.4\.ffn\.gate\.weight' has shape \(8, 63\)"):
        load_ours(d)
    bad = original["model.layers.0.ffn.gate.tid2eid"].clone()
    bad[17, 1] = 8
    save_file({**original, "model.layers.0.ffn.gate.tid2eid": bad}, d / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.0\.ffn\.gate\.tid2eid' routes to expert 8"):
        load_ours(d)


def test_mtp_layers_are_skipped_only_when_declared(
    saved: tuple[str, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    d = _copy(saved, tmp_path)
    mtp = "model.layers.5."  # num_hidden_layers = 5: the first NextN layer
    extra = {
        mtp + "enorm.weight": torch.ones(64), mtp + "hnorm.weight": torch.ones(64),
        mtp + "eh_proj.weight": torch.zeros(64, 128), mtp + "attn.wkv.weight": torch.zeros(32, 64),
        mtp + "ffn.experts.0.w1.weight": torch.zeros(32, 64), mtp + "hc_head_fn": torch.zeros(4, 256),
    }  # fmt: skip
    edit_tensors(d, lambda t: t.update(extra))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.5\."):
        load_ours(d)
    rewrite_config(d, num_nextn_predict_layers=1)
    model = load_ours(d)
    assert model.config.num_nextn_layers == 1 and len(model.layers) == 5


def test_cache_geometry_and_block_alignment(
    saved: tuple[str, dict[str, torch.Tensor]], tmp_path: Path
) -> None:
    config = hf_config(_copy(saved, tmp_path))
    d, di = 32, 16
    window = 5 * d
    states = 2 * (2 * d) + 2 * (4 * (d + di))
    # block 16: heavy layers (rate 8) keep 2 entries per block, sparse ones (rate 4) 4
    assert KVCache.bytes_per_block(config, 16, torch.float32) == 4 * (
        16 * (window + states) + 2 * 2 * d + 2 * 4 * (d + di)
    )
    # block 4: a heavy entry takes one slot per block (the block completing its window uses it)
    assert KVCache.bytes_per_block(config, 4, torch.float32) == 4 * (
        4 * (window + states) + 2 * d + 2 * (d + di)
    )
    cache = KVCache.allocate(config, 3, 16, torch.device("cpu"), torch.float32)
    assert cache.layout == "compressed" and cache.compressor(2) is None
    pools = cache.compressor(1)
    assert pools is not None and pools[0].shape == (48, 4 * (d + di)) and pools[1].shape == (12, d + di)
    for bad in (3, 6, 12):
        with pytest.raises(
            ConfigError, match=f"block_size={bad} does not align with layer 0's compression rate 8"
        ):
            KVCache.allocate(config, 3, bad, torch.device("cpu"), torch.float32)


def test_tied_head_loads_from_the_embedding(tmp_path: Path) -> None:
    hf = save_tiny_v4(tmp_path, tie_word_embeddings=True)
    model = load_ours(tmp_path)
    prompt = torch.randint(2, 256, (20,), generator=torch.Generator().manual_seed(9)).tolist()
    got = SequenceRunner(model, num_blocks=4, block_size=8).step([(0, prompt)])[0]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1]
    assert (got - want).abs().max().item() <= 1e-4
