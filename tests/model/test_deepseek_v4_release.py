"""DeepSeek's released V4 file layout: its tensor names, FP4 routed experts and ue8m0-scaled FP8
projections load to the model of the dequantized weights in our naming; bad tensors are named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepseek_quant_support import quantize_fp4, released_name, save_released
from deepseek_support import load_ours, save_tiny_v4
from safetensors.torch import load_file, save_file

from agent_infer.errors import ModelLoadError
from agent_infer.model.families.deepseek_v4_checkpoint import hf_tensor_name
from agent_infer.model.layers.fp8_linear import Fp8Linear
from agent_infer.model.loading.fp4 import dequantize_fp4, unpack_fp4
from agent_infer.model.runner import SequenceRunner

pytest.importorskip("transformers")

BLOCK = (32, 32)  # several blocks per projection, partial ones at the edges (wq_a has 48 rows)


@pytest.fixture(scope="module")
def released(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path, int]:
    d = tmp_path_factory.mktemp("release")
    save_tiny_v4(d / "f32")
    twin, fp4 = save_released(d / "f32", d / "release", BLOCK)
    return d / "f32", d / "release", twin, fp4


def _run(model: torch.nn.Module, prompt: list[int], steps: int) -> tuple[list[torch.Tensor], list[int]]:
    """Prefill, then ``steps`` greedy decode steps through the paged cache: every step's logits."""
    runner = SequenceRunner(model, num_blocks=16, block_size=8)  # type: ignore[arg-type]
    logits = [runner.step([(0, prompt)])[0]]
    tokens = []
    for _ in range(steps):
        tokens.append(int(logits[-1].argmax()))
        logits.append(runner.step([(0, [tokens[-1]])])[0])
    return logits, tokens


def test_release_loads_to_the_logits_of_its_dequantized_twin(released: tuple[Path, Path, Path, int]) -> None:
    original, release, twin, fp4 = released
    # every routed expert of the 5 layers (8 experts, w1/w2/w3) is FP4 in the release
    assert fp4 == 5 * 8 * 3
    names = json.loads((release / "model.safetensors.index.json").read_text())["weight_map"]
    assert "layers.1.ffn.experts.3.w2.scale" in names and "embed.weight" in names
    assert not any(n.startswith("model.") for n in names)
    prompt = torch.randint(2, 256, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    got, got_tokens = _run(load_ours(release), prompt, 16)
    want, want_tokens = _run(load_ours(twin), prompt, 16)
    assert got_tokens == want_tokens
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    plain, _ = _run(load_ours(original), prompt, 0)
    assert not torch.equal(got[0], plain[0])  # the quantization did change the weights


def test_release_names_are_the_ones_transformers_converts(tmp_path: Path) -> None:
    """transformers' own conversion table (DeepSeek's names -> its modules) loads a float checkpoint
    written in the release's names to the same model: the naming the loader maps is DeepSeek's."""
    import transformers

    hf = save_tiny_v4(tmp_path / "ours")
    (tmp_path / "release").mkdir()
    (tmp_path / "release" / "config.json").write_bytes((tmp_path / "ours" / "config.json").read_bytes())
    tensors = load_file(tmp_path / "ours" / "model.safetensors")
    renamed = {released_name(n): t for n, t in tensors.items()}
    assert all(hf_tensor_name(released_name(n)) == n for n in tensors)
    save_file(renamed, tmp_path / "release" / "model.safetensors", metadata={"format": "pt"})
    loaded = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "release").eval()
    prompt = torch.tensor([list(range(5, 40))])
    with torch.no_grad():
        assert torch.equal(loaded(prompt).logits, hf(prompt).logits)
    ours = SequenceRunner(load_ours(tmp_path / "release"), num_blocks=8, block_size=8).step(
        [(0, prompt[0].tolist())]
    )[0]
    assert (ours - hf(prompt).logits[0, -1]).abs().max().item() <= 1e-4


def test_fp4_values_and_group_scales() -> None:
    # bytes 0x21, 0xF7: columns 1.0 | 0.5 and 6.0 | -6.0 (even column in the low nibble)
    packed = torch.tensor([[0x21, 0xF7 - 256]], dtype=torch.int8)
    assert unpack_fp4(packed).tolist() == [[0.5, 1.0, 6.0, -6.0]]
    w = torch.randn(3, 70)  # 70 columns: three groups, the last one partial
    q, s = quantize_fp4(w)
    deq = dequantize_fp4("w", q, s, "w.scale")
    assert deq.shape == (3, 70)
    spread = s.float().repeat_interleave(32, 1)[:, :70]
    assert torch.equal(deq / spread, unpack_fp4(q))  # values times scales, exactly
    assert (deq - w).abs().max() <= spread.max() * 0.5  # e2m1's widest step (4 -> 6) halves to 1 scale unit


def _edit(release: Path, tmp: Path, edit: dict[str, torch.Tensor | None]) -> Path:
    """A copy of ``release`` with tensors replaced (None: removed)."""
    out = tmp / "edited"
    out.mkdir()
    (out / "config.json").write_bytes((release / "config.json").read_bytes())
    index = json.loads((release / "model.safetensors.index.json").read_text())["weight_map"]
    merged = {n: t for shard in sorted(set(index.values())) for n, t in load_file(release / shard).items()}
    for name, tensor in edit.items():
        if tensor is None:
            merged.pop(name)
        else:
            merged[name] = tensor
    save_file(merged, out / "model.safetensors")
    return out


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"layers.2.ffn.experts.4.w1.scale": torch.ones(32, 3).to(torch.float8_e8m0fnu)},
         r"'layers\.2\.ffn\.experts\.4\.w1\.scale' has shape \(32, 3\), expected \(32, 2\)"),
        ({"layers.2.ffn.experts.4.w1.scale": torch.ones(32, 2, dtype=torch.int32)},
         r"scale tensor 'layers\.2\.ffn\.experts\.4\.w1\.scale' is torch\.int32"),
        ({"layers.2.ffn.experts.4.w1.weight": torch.zeros(32, 32, dtype=torch.float16)},
         r"'layers\.2\.ffn\.experts\.4\.w1\.scale' scales 'layers\.2\.ffn\.experts\.4\.w1\.weight', which is torch\.float16"),
        ({"layers.2.ffn.experts.4.w1.weight": torch.zeros(32, 16, dtype=torch.int8),
          "layers.2.ffn.experts.4.w1.scale": torch.ones(32, 1).to(torch.float8_e8m0fnu)},
         r"'model\.layers\.2\.ffn\.experts\.4\.w1\.weight' has shape \(32, 32\), expected \(32, 64\)"),
        ({"layers.2.ffn.experts.4.w1.scale": None},
         r"packed FP4 tensor 'layers\.2\.ffn\.experts\.4\.w1\.weight' has no scale"),
        ({"layers.0.attn.wq_b.scale": None}, r"FP8 tensor 'layers\.0\.attn\.wq_b\.weight' has no scale"),
        ({"layers.0.attn.wq_b.scale": torch.full((4, 2), 255, dtype=torch.uint8).view(torch.float8_e8m0fnu)},
         r"scale tensor 'layers\.0\.attn\.wq_b\.scale' holds NaN or infinite values"),
        ({"layers.0.attn.wq_b.scale": torch.ones(4, 1).to(torch.float8_e8m0fnu)},
         r"'layers\.0\.attn\.wq_b\.scale' has shape \(4, 1\), expected \(4, 2\)"),
        ({"layers.1.ffn.gate.tid2eid": torch.zeros(256, 2, dtype=torch.int32).fill_(9)},
         r"'model\.layers\.1\.ffn\.gate\.tid2eid' routes to expert 9"),
        ({"layers.0.attn.kv_norm.weight": None}, r"missing tensors: model\.layers\.0\.attn\.norm\.weight"),
    ],
)  # fmt: skip
def test_bad_tensors_are_named(
    released: tuple[Path, Path, Path, int], tmp_path: Path, edit: dict[str, torch.Tensor | None], message: str
) -> None:
    with pytest.raises(ModelLoadError, match=message):
        load_ours(_edit(released[1], tmp_path, edit))


def test_fp4_needs_the_config_to_declare_it(released: tuple[Path, Path, Path, int], tmp_path: Path) -> None:
    out = _edit(released[1], tmp_path, {})
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("expert_dtype")
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"declares no FP4 weights \(expert_dtype 'fp4'\)"):
        load_ours(out)


def test_release_projections_can_stay_in_fp8(released: tuple[Path, Path, Path, int]) -> None:
    """With FP8 kept (the path of FP8-capable GPUs, run here on torch's CPU kernel), the release's
    ue8m0-scaled projections stay FP8: per layer ``wq_b`` and ``wo_b``, and the two indexers' ``wq_b``
    (the fused input projection mixes float32 compressor parts, so it is dequantized)."""
    _, release, twin, _ = released
    kept = load_ours(release, fp8="keep")
    names = sorted(p.name for m in kept.modules() if isinstance(m, Fp8Linear) for p in m.parts)
    assert len(names) == 5 * 2 + 2 and "model.layers.3.attn.indexer.wq_b.weight" in names
    prompt = torch.randint(2, 256, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    got = SequenceRunner(kept, num_blocks=8, block_size=8).step([(0, prompt)])[0]
    want = SequenceRunner(load_ours(twin), num_blocks=8, block_size=8).step([(0, prompt)])[0]
    # the activations' e4m3 rounding, compounded over five random layers and the indexers' top-k choices
    assert 1e-4 < ((got - want).norm() / want.norm()).item() <= 0.15
