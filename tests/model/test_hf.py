"""Hugging Face directories: tiny random Llama / Qwen2 checkpoints saved with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agent_infer.errors import ModelLoadError, UnsupportedModelError
from agent_infer.model.loader import default_model_path, load_model
from agent_infer.model.loading.gguf_reader import GGUFFile
from agent_infer.model.runner import SequenceRunner
from agent_infer.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 49152  # the SmolLM2 tokenizer is copied in, so the model must cover its ids


@pytest.fixture(scope="module")
def tokenizer_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    tok = Tokenizer.from_gguf_metadata(GGUFFile(default_model_path()).metadata)
    tok.hf_tokenizer.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": tok.chat_template})
    )
    return d


def _save(kind: str, directory: Path, tokenizer_files: Path, **save_kw: object) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, eos_token_id=0,
    )  # fmt: skip
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            **common,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    model.eval().save_pretrained(directory, **save_kw)
    for f in tokenizer_files.iterdir():
        (directory / f.name).write_bytes(f.read_bytes())
    return model


@pytest.mark.parametrize(("kind", "shard"), [("llama", None), ("qwen2", None), ("llama", "200KB")])
def test_matches_transformers(kind: str, shard: str | None, tmp_path: Path, tokenizer_files: Path) -> None:
    hf = _save(kind, tmp_path, tokenizer_files, **({"max_shard_size": shard} if shard else {}))
    if shard:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    lm = load_model(tmp_path, device=torch.device("cpu"))
    assert lm.config.architecture == kind and lm.config.attention_bias == (kind == "qwen2")
    if kind == "llama":
        assert lm.config.rope_scaling is not None and lm.config.rope_scaling["rope_type"] == "llama3"
    assert 2 in lm.tokenizer.eos_token_ids and 0 in lm.tokenizer.eos_token_ids  # <|im_end|> from the template
    ids = lm.tokenizer.encode(
        lm.tokenizer.apply_chat_template([{"role": "user", "content": "Hello there, model!"}])
    )
    # positions past original_max_position_embeddings exercise the llama3 RoPE scaling
    ids = (ids * 8)[:150]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    got = SequenceRunner(lm.model, num_blocks=16, block_size=16).step([(0, ids)])[0]
    assert (got - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())


def test_bad_directories(tmp_path: Path, tokenizer_files: Path) -> None:
    _save("llama", tmp_path, tokenizer_files)
    cfg = json.loads((tmp_path / "config.json").read_text())

    (tmp_path / "config.json").write_text(
        json.dumps({**cfg, "architectures": ["MambaForCausalLM"], "model_type": "mamba"})
    )
    with pytest.raises(UnsupportedModelError, match="'MambaForCausalLM'; supported: LlamaForCausalLM, llama"):
        load_model(tmp_path)
    bare = {k: v for k, v in cfg.items() if k != "architectures"}
    (tmp_path / "config.json").write_text(json.dumps({**bare, "model_type": "mamba"}))
    with pytest.raises(UnsupportedModelError, match="'mamba'"):
        load_model(tmp_path)

    (tmp_path / "config.json").write_text(
        json.dumps({**cfg, "rope_scaling": {"rope_type": "longrope", "factor": 2.0}})
    )
    with pytest.raises(UnsupportedModelError, match="longrope"):
        load_model(tmp_path)

    (tmp_path / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 65}))
    with pytest.raises(ModelLoadError, match=r"_proj\.weight' has shape \(\d+, \d+\), expected"):
        load_model(tmp_path)

    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    with pytest.raises(ModelLoadError, match=r"missing tensors: model\.layers\.2\."):
        load_model(tmp_path)

    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    with pytest.raises(ModelLoadError, match=r"unexpected tensor 'model\.layers\.1\."):
        load_model(tmp_path)

    (tmp_path / "config.json").write_text(json.dumps(cfg))
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(tmp_path)
    weights.unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        load_model(tmp_path)
