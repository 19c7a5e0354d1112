"""Gemma 3 from Hugging Face folders: a tiny random checkpoint saved with transformers, our logits
against transformers' through prefill, chunked prefill past the sliding window, and decoding."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch

from agent_infer.model.loader import default_model_path, load_model
from agent_infer.model.loading.gguf_reader import GGUFFile
from agent_infer.model.runner import SequenceRunner
from agent_infer.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
QT = gguf.GGMLQuantizationType

VOCAB = 49152  # the SmolLM2 tokenizer is copied in, so the model must cover its ids
WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
#: float32 on both sides; the paths differ in summation order only (fused q/k/v, SDPA vs eager).
RTOL = 1e-4


def _save(directory: Path, **overrides: object) -> torch.nn.Module:
    torch.manual_seed(0)
    settings: dict[str, object] = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, layer_types=LAYER_TYPES,
        query_pre_attn_scalar=24, max_position_embeddings=512, eos_token_id=0, bos_token_id=1,
    )  # fmt: skip
    cfg = transformers.Gemma3TextConfig(**{**settings, **overrides})
    model = transformers.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        # random norms too (they start at zero): the (1 + weight) convention must show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    directory.mkdir(parents=True, exist_ok=True)
    model.eval().save_pretrained(directory)
    _copy_tokenizer(directory)
    model.config._attn_implementation = "eager"
    return model


def _copy_tokenizer(directory: Path) -> None:
    tok = Tokenizer.from_gguf_metadata(GGUFFile(default_model_path()).metadata)
    tok.hf_tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


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


def _to_gguf(hf: torch.nn.Module, path: Path, layers: int) -> Path:
    """Write ``hf`` as llama.cpp's converter does: GGUF names, norms stored as ``1 + weight``, no
    merges needed for the SmolLM2 byte-level vocabulary copied in."""
    from agent_infer.model.families.gemma3_checkpoint import GGUF_GLOBAL_NAMES, GGUF_LAYER_NAMES

    c = hf.config
    meta = GGUFFile(default_model_path()).metadata
    w = gguf.GGUFWriter(str(path), arch="gemma3")
    w.add_block_count(layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_sliding_window(c.sliding_window)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(list(meta["tokenizer.ggml.tokens"]))
    w.add_token_types([int(t) for t in meta["tokenizer.ggml.token_type"]])
    w.add_token_merges(list(meta["tokenizer.ggml.merges"]))
    w.add_eos_token_id(0)
    hf_to_gguf = {v: k for k, v in GGUF_GLOBAL_NAMES.items()}
    layer_names = {v: k for k, v in GGUF_LAYER_NAMES.items()}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight":
            continue
        arr = t.float().numpy()
        if name.endswith("norm.weight"):
            arr = arr + 1.0
        if name in hf_to_gguf:
            w.add_tensor(hf_to_gguf[name], arr)
            continue
        _, _, i, rest = name.split(".", 3)
        target = f"blk.{i}.{layer_names[rest]}"
        if rest.startswith("mlp."):  # packed Q8_0: the native kernel's own block type
            w.add_tensor(target, gguf.quants.quantize(arr, QT.Q8_0), raw_dtype=QT.Q8_0)
            continue
        w.add_tensor(target, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_on_the_native_kernels_matches_transformers(tmp_path: Path) -> None:
    # six layers: the GGUF layout's pattern makes layer 5 global and 0-4 sliding
    types = ["sliding_attention"] * 5 + ["full_attention"]
    hf = _save(tmp_path / "hf", num_hidden_layers=6, layer_types=types, query_pre_attn_scalar=16)
    path = _to_gguf(hf, tmp_path / "g.gguf", 6)
    with torch.no_grad():  # the reference sees the Q8_0 values the file holds
        for name, p in hf.named_parameters():
            if ".mlp." in name:
                raw = gguf.quants.quantize(p.numpy(), QT.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(raw, QT.Q8_0)).reshape(p.shape))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENT_INFER_LINEAR_ACTIVATIONS", "f32")
        lm = load_model(path, device=torch.device("cpu"))
    assert lm.model.native and lm.config.layer_types == tuple(types)
    runner = SequenceRunner(lm.model, num_blocks=32, block_size=4)
    ids = torch.randint(2, VOCAB, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    logits = runner.step([(0, ids[:5])])[0]  # a short chunk on the native decode rows
    logits = runner.step([(0, ids[5:])])[0]
    _close(logits, _ref_logits(hf, ids))
    for _ in range(16):
        nxt = int(logits.argmax())
        ids.append(nxt)
        ref = _ref_logits(hf, ids)
        logits = runner.step([(0, [nxt])])[0]
        _close(logits, ref)
        assert int(logits.argmax()) == int(ref.argmax())


def test_multimodal_checkpoint_loads_its_text_decoder(tmp_path: Path) -> None:
    torch.manual_seed(0)
    text = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, layer_types=LAYER_TYPES[:2],
        max_position_embeddings=512,
    )  # fmt: skip
    vision = dict(
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    hf = transformers.Gemma3ForConditionalGeneration(
        transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    )
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.5)
    hf.eval().save_pretrained(tmp_path)
    _copy_tokenizer(tmp_path)
    ours = load_model(tmp_path, device=torch.device("cpu"))
    assert ours.config.architecture == "gemma3" and ours.config.num_layers == 2
    ids = torch.randint(2, VOCAB, (20,), generator=torch.Generator().manual_seed(4)).tolist()
    got = SequenceRunner(ours.model, num_blocks=16, block_size=4).step([(0, ids)])[0]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0, -1]
    _close(got, ref)


def test_text_defaults_are_transformers_defaults() -> None:
    from agent_infer.model.families.gemma3_checkpoint import TEXT_CONFIG_DEFAULTS

    ref = transformers.Gemma3TextConfig()
    rope = ref.rope_parameters
    for key, value in TEXT_CONFIG_DEFAULTS.items():
        if key == "rope_theta":
            assert value == rope["full_attention"]["rope_theta"]
        elif key == "rope_local_base_freq":
            assert value == rope["sliding_attention"]["rope_theta"]
        else:
            assert getattr(ref, key) == value, key
