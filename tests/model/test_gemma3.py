"""Gemma 3 from Hugging Face folders: a tiny random checkpoint saved with transformers, our logits
against transformers' through prefill, chunked prefill past the sliding window, and decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from agent_infer.model.loader import default_model_path, load_model
from agent_infer.model.loading.gguf_reader import GGUFFile
from agent_infer.model.runner import SequenceRunner
from agent_infer.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 49152  # the SmolLM2 tokenizer is copied in, so the model must cover its ids
WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
#: float32 on both sides; the paths differ in summation order only (fused q/k/v, SDPA vs eager).
RTOL = 1e-4


def _save(directory: Path, **overrides: object) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, layer_types=LAYER_TYPES,
        query_pre_attn_scalar=24, max_position_embeddings=512, eos_token_id=0, bos_token_id=1,
        **overrides,
    )  # fmt: skip
    model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        # random norms too (they start at zero): the (1 + weight) convention must show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    model.eval().save_pretrained(directory)
    tok = Tokenizer.from_gguf_metadata(GGUFFile(default_model_path()).metadata)
    tok.hf_tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    model.config._attn_implementation = "eager"
    return model


def _ref_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1]


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    err = (got - ref).abs().max().item()
    assert err < RTOL * max(1.0, ref.abs().max().item()), err


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_matches_transformers_through_the_paged_cache(tmp_path: Path, softcap: float | None) -> None:
    hf = _save(tmp_path, final_logit_softcapping=softcap)
    lm = load_model(tmp_path, device=torch.device("cpu"))
    c = lm.config
    assert c.architecture == "gemma3" and c.sliding_window == WINDOW and c.layer_types == tuple(LAYER_TYPES)
    assert c.query_pre_attn_scalar == 24 and c.rope_local_theta == 10000.0 and c.rope_theta == 1_000_000.0
    assert c.final_logit_softcapping == softcap and c.tie_word_embeddings
    runner = SequenceRunner(lm.model, num_blocks=32, block_size=4)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (20,), generator=g).tolist()
    # chunked prefill: the second chunk's queries see keys both inside and beyond the window
    runner.step([(0, ids[:7])])
    logits = runner.step([(0, ids[7:])])[0]
    _close(logits, _ref_logits(hf, ids))
    for _ in range(16):
        nxt = int(logits.argmax())
        ref = _ref_logits(hf, [*ids, nxt])
        ids.append(nxt)
        logits = runner.step([(0, [nxt])])[0]
        _close(logits, ref)
        assert int(logits.argmax()) == int(ref.argmax())


def test_window_is_batch_invariant(tmp_path: Path) -> None:
    _save(tmp_path)
    lm = load_model(tmp_path, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(2)
    long, short = torch.randint(2, VOCAB, (30,), generator=g).tolist(), [5, 6, 7]
    alone = SequenceRunner(lm.model, num_blocks=32, block_size=4)
    a = [alone.step([(0, long)])[0], alone.step([(1, short)])[0]]
    together = SequenceRunner(lm.model, num_blocks=32, block_size=4).step([(0, long), (1, short)])
    assert torch.equal(together[0], a[0]) and torch.equal(together[1], a[1])
