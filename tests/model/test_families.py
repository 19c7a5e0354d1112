"""Qwen 3, Llama 3.x and Mistral against transformers on tiny random float32 checkpoints.

Each family's checkpoint (2 layers) is loaded three ways: from its Hugging Face folder (torch path),
and from a GGUF file written from the same weights, through the packed native kernels (float32
activations) and through torch. Prefill plus 16 greedy decode steps through the paged cache must
give transformers' greedy tokens exactly and logits within TOLERANCE of its logit scale. A second
GGUF per family holds the 2-D weights as Q8_0 blocks (transformers gets the same rounded weights)
and runs on the packed kernels with float32 and with int8 activations (the loader's default).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from family_support import VOCAB, compare_with_transformers, randomize, round_through, save_hf, write_gguf

from agent_infer.errors import ModelLoadError
from agent_infer.model.config import rope_inv_freq
from agent_infer.model.loader import LoadedModel, load_model
from agent_infer.model.runner import SequenceRunner

transformers = pytest.importorskip("transformers")
QT = gguf.GGMLQuantizationType

# Max |ours - transformers| over the compared logits, as a fraction of max(1, largest |logit|).
# Float32 on both sides; the rest is summation order (MKL vs the native kernels' FMA chains, SDPA vs
# the native decode kernel). Measured up to 1.3e-6 on these models; bound with ~8x headroom.
TOLERANCE = 1e-5
# int8 activations (llama.cpp's Q8 scheme) round every activation per block of 32: measured up to
# 4.4% of the logit scale and a mean KL(transformers || ours) of 5.3e-4 nats; bounds with ~2x/4x headroom.
Q8_TOLERANCE = 0.08
Q8_MEAN_KL = 2e-3
WINDOW = 8
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
LLAMA3_SCALING = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}  # fmt: skip


def llama_cpp_rope_freqs(config: Any) -> np.ndarray:
    """The ``rope_freqs`` tensor llama.cpp's converter writes for a Llama 3.1+ checkpoint."""
    rope = config.rope_parameters
    dim = config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _qwen3(tie: bool) -> Any:
    return transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=tie, rope_theta=1e6)
    )


def _qwen3_moe() -> Any:
    config = transformers.Qwen3MoeConfig(
        **COMMON, head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
        norm_topk_prob=True, tie_word_embeddings=False, rope_theta=1e6,
    )  # fmt: skip
    return transformers.Qwen3MoeForCausalLM(config)


def _moe_metadata(w: gguf.GGUFWriter) -> None:
    w.add_expert_count(4)
    w.add_expert_used_count(2)
    w.add_expert_feed_forward_length(48)


def _llama3() -> Any:
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **COMMON, rope_theta=5e5, rope_scaling=LLAMA3_SCALING, tie_word_embeddings=False
        )
    )


def _mistral() -> Any:
    return transformers.MistralForCausalLM(
        transformers.MistralConfig(**COMMON, sliding_window=WINDOW, rope_theta=1e4, tie_word_embeddings=False)
    )


def _llama3_gguf_extras(model: Any) -> dict[str, np.ndarray]:
    return {"rope_freqs.weight": llama_cpp_rope_freqs(model.config)}


#: family -> (transformers model, GGUF arch, GGUF metadata, extra GGUF tensors)
FAMILIES: dict[
    str, tuple[Callable[[], Any], str, Callable[[gguf.GGUFWriter], None], Callable[[Any], dict]]
] = {
    "qwen3-tied": (lambda: _qwen3(True), "qwen3", lambda w: None, lambda m: {}),
    "qwen3-untied": (lambda: _qwen3(False), "qwen3", lambda w: None, lambda m: {}),
    "qwen3-moe": (_qwen3_moe, "qwen3moe", _moe_metadata, lambda m: {}),
    "llama3": (_llama3, "llama", lambda w: None, _llama3_gguf_extras),
    "mistral": (_mistral, "llama", lambda w: w.add_sliding_window(WINDOW), lambda m: {}),
}
PATHS = ["hf", "gguf-native", "gguf-torch"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, Path, Path]]:
    """Per family: the transformers model, its HF folder and its GGUF file."""
    out = {}
    for i, (family, (make, arch, metadata, extras)) in enumerate(FAMILIES.items()):
        torch.manual_seed(i)
        model = randomize(make(), seed=i)
        d = save_hf(model, tmp_path_factory.mktemp(family))
        path = write_gguf(
            d.parent / f"{family}.gguf", model, arch, metadata=metadata, extra_tensors=extras(model)
        )
        out[family] = (model, d, path)
    return out


def _load(path: Path, kind: str, monkeypatch: pytest.MonkeyPatch) -> LoadedModel:
    monkeypatch.setenv("AGENT_INFER_NATIVE_LINEAR", "1" if kind == "gguf-native" else "0")
    monkeypatch.setenv("AGENT_INFER_LINEAR_ACTIVATIONS", "f32")
    lm = load_model(path, device=torch.device("cpu"))
    assert lm.model.native == (kind == "gguf-native")
    return lm


def _prompt(n: int = 40, seed: int = 7) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kind", PATHS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_and_decode_match_transformers(
    family: str, kind: str, checkpoints: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    hf, folder, path = checkpoints[family]
    lm = _load(folder if kind == "hf" else path, kind, monkeypatch)
    c = lm.config
    assert (c.num_layers, c.head_dim, c.tie_word_embeddings) == (
        2,
        hf.config.head_dim,
        hf.config.tie_word_embeddings,
    )
    assert c.sliding_window == (WINDOW if family == "mistral" else None)
    err = compare_with_transformers(lm, hf, _prompt())
    print(f"{family} {kind}: max relative logit error {err:.3g}")
    assert err <= TOLERANCE


@pytest.fixture(scope="module")
def q8_0_checkpoints(
    checkpoints: dict, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Any, Path]]:
    """Per family: a copy of the transformers model with its 2-D weights rounded through Q8_0, and
    the GGUF file holding those weights as Q8_0 blocks (the kernel's int8-activation type)."""
    d = tmp_path_factory.mktemp("q8_0")
    out = {}
    for family, (_, arch, metadata, extras) in FAMILIES.items():
        hf = round_through(copy.deepcopy(checkpoints[family][0]), QT.Q8_0)
        path = write_gguf(
            d / f"{family}.gguf", hf, arch, metadata=metadata, extra_tensors=extras(hf), quant=QT.Q8_0
        )
        out[family] = (hf, path)
    return out


@pytest.mark.parametrize("activations", ["f32", "q8"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_q8_0_gguf_on_the_native_path(
    family: str, activations: str, q8_0_checkpoints: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q8_0 weights on the packed kernels: with float32 activations as exact as float32 weights;
    with int8 activations (the loader's default) within Q8_TOLERANCE and Q8_MEAN_KL of
    transformers, teacher-forced on transformers' greedy tokens (near ties may flip, so greedy
    decoding is not compared)."""
    hf, path = q8_0_checkpoints[family]
    monkeypatch.setenv("AGENT_INFER_NATIVE_LINEAR", "1")
    monkeypatch.setenv("AGENT_INFER_LINEAR_ACTIVATIONS", activations)
    lm = load_model(path, device=torch.device("cpu"))
    assert lm.model.native and lm.model.lm_head.packed.ggml_type == int(QT.Q8_0)
    assert lm.model.lm_head.packed.q8_activations == (activations == "q8")
    if activations == "f32":
        assert compare_with_transformers(lm, hf, _prompt()) <= TOLERANCE
        return
    prompt = _prompt()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None)
        gen = out[0, len(prompt) :].tolist()
        ref = hf(torch.tensor([prompt + gen])).logits[0, len(prompt) - 1 :].float()
    runner = SequenceRunner(lm.model, num_blocks=20, block_size=4)
    ours = torch.stack([runner.step([(0, prompt)])[0]] + [runner.step([(0, [t])])[0] for t in gen])
    err = (ours - ref).abs().max().item() / ref.abs().max().item()
    lp, lr = ours.log_softmax(-1), ref.log_softmax(-1)
    kl = (lr.exp() * (lr - lp)).sum(-1).mean().item()
    print(f"{family} q8: max relative logit error {err:.3g}, mean KL {kl:.3g}")
    assert err <= Q8_TOLERANCE and kl <= Q8_MEAN_KL


def test_qwen3_head_dim_and_qk_norm(checkpoints: dict) -> None:
    hf, folder, _ = checkpoints["qwen3-untied"]
    lm = load_model(folder, device=torch.device("cpu"))
    assert lm.config.architecture == "qwen3" and lm.config.head_dim * 4 != lm.config.hidden_size
    # the QK norm is load-bearing: with unit norm weights the logits move far from transformers'
    block = lm.model.layers[0]
    block.q_norm.weight.data.fill_(1.0)
    with pytest.raises(AssertionError):
        assert compare_with_transformers(lm, hf, _prompt(), steps=1) <= TOLERANCE


def test_llama3_rope_matches_transformers_rope_init(checkpoints: dict) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf, folder, path = checkpoints["llama3"]
    want, scale = ROPE_INIT_FUNCTIONS["llama3"](hf.config, torch.device("cpu"))
    assert scale == 1.0
    from_hf = load_model(folder, device=torch.device("cpu")).config
    from_gguf = load_model(path, device=torch.device("cpu")).config
    assert from_hf.rope_scaling == {**LLAMA3_SCALING, "rope_theta": 5e5} and from_hf.rope_freq_factors is None
    assert from_gguf.rope_scaling is None and from_gguf.rope_freq_factors is not None
    # the same formula as transformers' in the same float32 ops: equal bits
    assert torch.equal(rope_inv_freq(from_hf), want)
    # llama.cpp's divisors (1 / the smoothed factor) round differently: within 2 float32 ulps
    torch.testing.assert_close(rope_inv_freq(from_gguf), want, rtol=2.5e-7, atol=0)
    # the scaling bites: some pairs slowed by the full factor, some kept, some smoothed
    plain = rope_inv_freq(dataclasses.replace(from_hf, rope_scaling=None))
    ratio = (plain / want).tolist()
    assert min(ratio) == pytest.approx(1.0) and max(ratio) == pytest.approx(8.0)
    assert any(1.01 < r < 7.99 for r in ratio)


def test_mistral_window_is_what_transformers_does(checkpoints: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    hf, folder, path = checkpoints["mistral"]
    prompt = _prompt(30, seed=11)
    for kind, source, native_query in (
        ("hf", folder, 0),
        ("gguf-native", path, 512),
        ("gguf-native", path, 4),
    ):
        lm = _load(source, kind, monkeypatch)
        # 4: the 17-token chunk goes through SDPA, its decode rows through the native kernel
        lm.model.attention.max_native_query = native_query
        # chunked prefill: a chunk whose queries see windows starting at different keys
        runner = SequenceRunner(lm.model, num_blocks=12, block_size=4)
        runner.step([(0, prompt[:13])])
        last = runner.step([(0, prompt[13:])])[0]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1]
        assert (last - ref).abs().max().item() <= TOLERANCE * max(1.0, ref.abs().max().item())
    # the window matters here: transformers without it disagrees
    monkeypatch.setattr(hf.config, "sliding_window", None)
    with torch.no_grad():
        full = hf(torch.tensor([prompt])).logits[0, -1]
    assert (full - ref).abs().max().item() > 100 * TOLERANCE * max(1.0, ref.abs().max().item())


def _edit_config(folder: Path, tmp_path: Path, **changes: Any) -> Path:
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    shutil.copytree(folder, d, dirs_exist_ok=True)
    cfg = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_unsupported_config_values_name_their_key(checkpoints: dict, tmp_path: Path) -> None:
    _, llama3, llama3_gguf = checkpoints["llama3"]
    rope = json.loads((llama3 / "config.json").read_text())["rope_parameters"]
    cases: list[tuple[Path, str]] = [
        (
            _edit_config(llama3, tmp_path, rope_parameters={**rope, "rope_type": "longrope"}),
            "rope_scaling type 'longrope'",
        ),
        (
            _edit_config(
                llama3, tmp_path, rope_parameters={k: v for k, v in rope.items() if k != "low_freq_factor"}
            ),
            "rope_scaling of type 'llama3' lacks low_freq_factor",
        ),
        (_edit_config(checkpoints["qwen3-tied"][1], tmp_path, use_sliding_window=True), "use_sliding_window"),
        (
            _edit_config(
                checkpoints["mistral"][1], tmp_path, layer_types=["sliding_attention", "full_attention"]
            ),
            "layer_types",
        ),
    ]
    for folder, message in cases:
        with pytest.raises(ModelLoadError, match=message):
            load_model(folder, device=torch.device("cpu"))
    hf = checkpoints["llama3"][0]
    bad = write_gguf(
        tmp_path / "yarn.gguf",
        hf,
        "llama",
        metadata=lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.YARN),
    )
    with pytest.raises(ModelLoadError, match=r"llama\.rope\.scaling\.type 'yarn'"):
        load_model(bad, device=torch.device("cpu"))
    short = write_gguf(
        tmp_path / "freqs.gguf",
        hf,
        "llama",
        extra_tensors={"rope_freqs.weight": np.ones(3, dtype=np.float32)},
    )
    with pytest.raises(ModelLoadError, match="rope_freq_factors has 3 entries for head_dim 16"):
        load_model(short, device=torch.device("cpu"))
    # Mixtral's GGUFs are `llama` files with experts: not a layout the Llama family reads
    mixtral = write_gguf(tmp_path / "experts.gguf", hf, "llama", metadata=_moe_metadata)
    with pytest.raises(ModelLoadError, match=r"llama models with experts \(expert_count / num_experts\)"):
        load_model(mixtral, device=torch.device("cpu"))
    assert llama3_gguf.is_file()


def test_qwen3_moe_config_keys(checkpoints: dict, tmp_path: Path) -> None:
    folder = checkpoints["qwen3-moe"][1]
    # the hub's Qwen3-MoE configs name the expert count `num_experts`
    hub = _edit_config(folder, tmp_path, num_local_experts=None, num_experts=4)
    c = load_model(hub, device=torch.device("cpu")).config
    assert c.moe is not None and (c.moe.num_experts, c.moe.top_k, c.moe.intermediate_size) == (4, 2, 48)
    assert c.moe.renormalize
    with pytest.raises(ModelLoadError, match="decoder_sparse_step/mlp_only_layers"):
        load_model(_edit_config(folder, tmp_path, decoder_sparse_step=2), device=torch.device("cpu"))
    with pytest.raises(ModelLoadError, match=r"num_experts_per_tok=5 must be in \[1, num_experts=4\]"):
        load_model(_edit_config(folder, tmp_path, num_experts_per_tok=5), device=torch.device("cpu"))


def test_mistral_rows_are_batch_invariant_across_window_forms(
    checkpoints: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short sequence decodes from block tables alone, from single-slot tables when batched with
    one past the window: the native kernel must give the same bits either way."""
    lm = _load(checkpoints["mistral"][2], "gguf-native", monkeypatch)
    short, long = _prompt(5, seed=1), _prompt(30, seed=2)
    alone = SequenceRunner(lm.model, num_blocks=24, block_size=4)
    batched = SequenceRunner(lm.model, num_blocks=24, block_size=4)
    a = alone.step([(0, short)])
    b = batched.step([(1, long), (0, short)])
    assert torch.equal(a[0], b[1])
    for _ in range(6):  # the short one crosses the window too
        tok = int(a[0].argmax())
        a = alone.step([(0, [tok])])
        b = batched.step([(1, [int(b[0].argmax())]), (0, [tok])])
        assert torch.equal(a[0], b[1])


@pytest.mark.parametrize("family", ["mistral", "qwen3-moe"])
def test_engine_greedy_equals_transformers(family: str, checkpoints: dict) -> None:
    """Through the engine (scheduler, block manager, sampler): a batch of two prompts, greedy."""
    from agent_infer.llm import LLM
    from agent_infer.sampling_params import SamplingParams

    hf, _, path = checkpoints[family]
    llm = LLM(str(path))
    prompts = [_prompt(21, seed=3), _prompt(9, seed=4)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1].argmax(-1)
        assert out.token_ids == ref.tolist()
