"""The packed linear kernel's int8-activation mode (``q8_activations``, see engine_native/src/kernels/linear_q8.h).

A numpy model of the mode's arithmetic (per-block int8 quantization of x, exact integer block dot
products, the fixed float epilogue) gives the expected bits; every ISA and batch must produce them.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from agent_infer.model.layers import native_ops, qlinear
from agent_infer.model.layers.norm import RMSNorm
from agent_infer.native import load_native

# the extension is part of the build: a missing or stale one fails here instead of skipping
_native = load_native()
assert native_ops.available(), f"agent_infer._native lacks a model kernel of {native_ops.MODEL_KERNELS}"

F32, Q4_0, Q4_1, Q8_0 = 0, 2, 3, 8
QTYPES = [Q4_1, Q8_0, Q4_0]


def _isas() -> list[str]:
    found = []
    for isa in ("avx512", "avx2", "scalar"):
        try:
            _native.linear_set_isa(isa)
            found.append(isa)
        except ValueError:
            pass
    _native.linear_set_isa("best")
    return found


ISAS = _isas()


@pytest.fixture(autouse=True)
def _restore_isa() -> Iterator[None]:
    yield
    _native.linear_set_isa("best")


def _blocks(
    ggml_type: int, n: int, k: int, seed: int
) -> tuple[torch.Tensor, np.ndarray, np.ndarray, np.ndarray]:
    """GGUF bytes for [n, k] plus the integer weights q [n, k], scales d and mins m [n, k/32]."""
    rng = np.random.default_rng(seed)
    nb = n * k // 32
    d = (rng.uniform(0.001, 0.05, nb) * rng.choice([-1, 1], nb)).astype(np.float16)
    m = np.zeros(nb, dtype=np.float16)
    if ggml_type == Q8_0:
        q = rng.integers(-128, 128, (nb, 32), dtype=np.int8)
        raw = np.concatenate([d.view(np.uint8).reshape(nb, 2), q.view(np.uint8)], axis=1)
        qi = q.astype(np.int64)
    else:
        qs = rng.integers(0, 256, (nb, 16), dtype=np.uint8)
        lo, hi = (qs & 15).astype(np.int64), (qs >> 4).astype(np.int64)
        qi = np.concatenate([lo, hi], axis=1)  # ggml: low nibbles are elements 0..15
        if ggml_type == Q4_0:
            qi = qi - 8
            raw = np.concatenate([d.view(np.uint8).reshape(nb, 2), qs], axis=1)
        else:
            m = rng.uniform(-0.4, 0.1, nb).astype(np.float16)
            raw = np.concatenate(
                [d.view(np.uint8).reshape(nb, 2), m.view(np.uint8).reshape(nb, 2), qs], axis=1
            )
    packed_bytes = torch.from_numpy(np.ascontiguousarray(raw)).reshape(-1)
    shape = (n, k // 32)
    return (
        packed_bytes,
        qi.reshape(n, k),
        d.astype(np.float32).reshape(shape),
        m.astype(np.float32).reshape(shape),
    )


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    # a*b is exact in float64 for float32 inputs; one float64 add then a float32 rounding equals a
    # single-rounding fma except at astronomically rare double-rounding ties
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def _expected(x: np.ndarray, qw: np.ndarray, d: np.ndarray, m: np.ndarray, with_min: bool) -> np.ndarray:
    rows, k = x.shape
    nb = k // 32
    xb = x.reshape(rows, nb, 32)
    amax = np.abs(xb).max(axis=2)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    xq = np.clip(np.round(xb * inv[:, :, None]), -127, 127).astype(np.int64)  # round half to even
    dx = (amax / np.float32(127.0)).astype(np.float32)
    sx = (xq.sum(axis=2).astype(np.float32) * dx).astype(np.float32)
    wq = qw.reshape(qw.shape[0], nb, 32)
    acc = np.zeros((rows, qw.shape[0]), dtype=np.float32)
    for b in range(nb):
        isum = xq[:, b, :] @ wq[:, b, :].T  # exact integers
        p = (isum.astype(np.float32) * dx[:, b : b + 1]).astype(np.float32)
        acc = _fma(p, d[None, :, b], acc)
        if with_min:
            acc = _fma(np.broadcast_to(sx[:, b : b + 1], acc.shape), m[None, :, b], acc)
    return acc


def _run(packed: object, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
    out = torch.empty(x.shape[0], packed.n)  # type: ignore[attr-defined]
    packed.forward(x, out, threads)  # type: ignore[attr-defined]
    return out


@pytest.mark.parametrize("ggml_type", QTYPES)
@pytest.mark.parametrize("shape", [(1, 32), (17, 64), (45, 96), (133, 160)])
def test_bits_equal_the_numpy_model_on_every_isa(ggml_type: int, shape: tuple[int, int]) -> None:
    n, k = shape
    raw, qw, d, m = _blocks(ggml_type, n, k, seed=n + k)
    packed = _native.PackedLinear(raw, ggml_type, n, k, q8_activations=True)
    assert packed.q8_activations
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(2))
    x[3, :32] = 0.0  # an all-zero block: scale 0, every product 0
    x[4, 5] = 1e4  # one outlier block
    want = _expected(x.numpy(), qw, d, m, with_min=ggml_type == Q4_1)
    for isa in ISAS:
        _native.linear_set_isa(isa)
        for rows in (1, 2, 3, 5, 8, 9, 19):
            got = _run(packed, x[:rows].contiguous(), threads=2).numpy()
            assert np.array_equal(got, want[:rows]), (isa, rows)


@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0])
def test_rows_bit_identical_for_any_batch_and_thread_count(ggml_type: int) -> None:
    n, k = 133, 96
    raw, *_ = _blocks(ggml_type, n, k, seed=7)
    packed = _native.PackedLinear(raw, ggml_type, n, k, q8_activations=True)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([_run(packed, x[r : r + 1].contiguous()) for r in range(x.shape[0])])
    for rows in (2, 4, 7, 8, 9, 16, 17, 37):
        for threads in (1, 2, 3, 16):
            assert torch.equal(_run(packed, x[:rows].contiguous(), threads), alone[:rows]), (rows, threads)


@pytest.mark.parametrize("ggml_type", QTYPES)
def test_close_to_float32_activations(ggml_type: int) -> None:
    """Int8 rounding of x moves each output by a small fraction of the summed magnitudes."""
    n, k = 64, 512
    raw, *_ = _blocks(ggml_type, n, k, seed=5)
    exact = _native.PackedLinear(raw, ggml_type, n, k)
    q8 = _native.PackedLinear(raw, ggml_type, n, k, q8_activations=True)
    assert not exact.q8_activations
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(6))
    want, got = _run(exact, x), _run(q8, x)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 0.03 * scale
    assert not torch.equal(got, want)  # the mode really quantizes


def test_masked_head_in_q8_mode_equals_forward() -> None:
    n, k = 200, 64
    raw, *_ = _blocks(Q8_0, n, k, seed=13)
    packed = _native.PackedLinear(raw, Q8_0, n, k, q8_activations=True)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(9))
    full = _run(packed, x, 2)
    bits = np.zeros((3, (n + 31) // 32), dtype=np.uint32)
    bits[0, 1] = 1  # column 32: group 2
    bits[2, 6] = 1 << 7  # column 199: group 12 (partial)
    out = torch.empty(3, n)
    computed = packed.forward_allowed(x, out, torch.from_numpy(bits.view(np.int32).copy()), 2)
    assert computed == 2
    for g in (2, 12):
        cols = slice(16 * g, min(n, 16 * g + 16))
        assert torch.equal(out[:, cols], full[:, cols])
    assert bool(torch.all(out[:, 48:64] == float("-inf")))


def test_float_weights_refuse_q8_and_layers_follow_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.randn(16, 32)
    with pytest.raises(ValueError, match="int8 activations need quantized weights"):
        _native.PackedLinear(w.reshape(-1).view(torch.uint8), F32, 16, 32, q8_activations=True)
    raw, *_ = _blocks(Q4_1, 16, 32, seed=1)
    part = (raw.view(16, -1), Q4_1, 16)
    assert qlinear.QuantLinear.from_rows([part], 32, q8_activations=True).packed.q8_activations
    assert not qlinear.QuantLinear.from_rows([part], 32).packed.q8_activations
    f32_part = (w.contiguous().view(torch.uint8).view(16, -1), F32, 16)
    # float weights keep float activations even when q8 is asked for
    assert not qlinear.QuantLinear.from_rows([f32_part], 32, q8_activations=True).packed.q8_activations

    from agent_infer.envs import linear_activations
    from agent_infer.errors import ConfigError

    monkeypatch.setenv("AGENT_INFER_LINEAR_ACTIVATIONS", "int4")
    with pytest.raises(ConfigError, match="AGENT_INFER_LINEAR_ACTIVATIONS"):
        linear_activations()


@pytest.mark.parametrize("q8", [True, False])
def test_fused_rms_norm_matches_torch_and_is_batch_invariant(q8: bool) -> None:
    """``project_normed`` = ``project(rms_norm(x) * w)``: the norm to float rounding, rows invariant."""
    n, k = 80, 96
    raw, *_ = _blocks(Q4_1, n, k, seed=21)
    layer = qlinear.QuantLinear.from_rows([(raw.view(n, -1), Q4_1, n)], k, q8_activations=q8)
    x = torch.randn(13, k, generator=torch.Generator().manual_seed(4)) * 3
    w = torch.rand(k, generator=torch.Generator().manual_seed(5)) + 0.5
    eps = 1e-5
    norm = RMSNorm(k, eps, None, torch.float32)
    norm.weight.data.copy_(w)
    got = layer.project_normed(x, norm)
    normed = torch.nn.functional.rms_norm(x.double(), (k,), w.double(), eps).float()
    # the normalized rows agree with torch's to float rounding, so the kernel sees (nearly) the same
    # input: float32 activations give the same outputs to rounding, int8 ones at most a rounding
    # step of a few activations apart
    want = layer.project(normed)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= (2e-2 if q8 else 1e-5) * scale
    alone = torch.cat([layer.project_normed(x[r : r + 1], norm) for r in range(13)])
    assert torch.equal(got, alone)
    for isa in ISAS:
        _native.linear_set_isa(isa)
        assert torch.equal(layer.project_normed(x, norm), got), isa
    # inputs the raw path cannot take fall back to torch's norm and forward()
    assert torch.allclose(
        layer.project_normed(x.t().contiguous().t(), norm), got, rtol=0, atol=(2e-2 if q8 else 1e-5) * scale
    )


def test_non_finite_activations_stay_in_their_row() -> None:
    """An inf or NaN activation (a diverged model) never reaches an undefined float-to-int cast,
    and the other rows' bits are untouched."""
    n, k = 48, 64
    raw, *_ = _blocks(Q4_1, n, k, seed=17)
    packed = _native.PackedLinear(raw, Q4_1, n, k, q8_activations=True)
    x = torch.randn(4, k, generator=torch.Generator().manual_seed(8))
    clean = _run(packed, x)
    bad = x.clone()
    bad[1, 3] = float("inf")
    bad[2, 40] = float("nan")
    for isa in ISAS:
        _native.linear_set_isa(isa)
        got = _run(packed, bad, 2)
        assert torch.equal(got[0], clean[0]) and torch.equal(got[3], clean[3]), isa
