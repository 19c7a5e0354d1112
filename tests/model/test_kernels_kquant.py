"""Native packed Q5_0, Q4_K and Q6_K weights (engine_native/src/kernels/linear_blocks.h).

Float32 activations read back exactly the loader's dequantized values (the bit-exact llama.cpp
dequantization of ``gguf_quants.py``); int8 activations give the bits of a numpy model of the kernel's
arithmetic, on every ISA and for any batch, and stay within a stated tolerance of the dequantized matmul.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from agent_infer.model.layers import native_ops, qlinear
from agent_infer.model.loading.gguf_reader import _DEQUANT
from agent_infer.model.loading.gguf_transcode import Q8_0, to_q8_0
from agent_infer.native import load_native

_native = load_native()
assert native_ops.available(), f"agent_infer._native lacks a model kernel of {native_ops.MODEL_KERNELS}"

Q4_0, Q5_0, Q4_K, Q6_K = 2, 6, 12, 14
TYPES = [Q5_0, Q4_K, Q6_K]
_BLOCK = {Q4_0: (32, 18), Q5_0: (32, 22), Q4_K: (256, 144), Q6_K: (256, 210)}
#: Int8 activations: max |ours - x @ W^T| relative to the largest |x @ W^T| on these random layers
#: (x rounded to 8 bits per block of 32; measured 0.5-0.7%).
Q8_RTOL = 0.02


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


def _f16(rng: np.random.Generator, lo: float, hi: float, count: int, signed: bool) -> np.ndarray:
    v = rng.uniform(lo, hi, count) * (rng.choice([-1, 1], count) if signed else 1)
    return v.astype(np.float16).view(np.uint8).reshape(count, 2)


def _raw(ggml_type: int, n: int, k: int, seed: int) -> torch.Tensor:
    """Random blocks (every code and scale bit random) with realistic fp16 super-scales."""
    rng = np.random.default_rng(seed)
    values, size = _BLOCK[ggml_type]
    nb = n * k // values
    b = rng.integers(0, 256, (nb, size), dtype=np.uint8)
    if ggml_type == Q4_K:
        b[:, 0:2] = _f16(rng, 0.0005, 0.003, nb, signed=False)
        b[:, 2:4] = _f16(rng, 0.0, 0.002, nb, signed=False)
    elif ggml_type == Q6_K:
        b[:, 208:210] = _f16(rng, 0.0001, 0.001, nb, signed=True)
    else:
        b[:, 0:2] = _f16(rng, 0.001, 0.05, nb, signed=True)
    return torch.from_numpy(b.reshape(-1).copy())


def _codes(ggml_type: int, raw: torch.Tensor, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Integer codes ``q`` [n, k], the scale of every 16 weights [n, k/16] and the added minimum of
    every 32 [n, k/32], decoded from ggml's block layouts (``w = q*d`` or ``w = q*d + m``)."""
    values, size = _BLOCK[ggml_type]
    b = raw.numpy().reshape(-1, size)
    nb = b.shape[0]

    def half(col: int) -> np.ndarray:
        return b[:, col : col + 2].copy().view(np.float16).astype(np.float32)

    mins = np.zeros((nb, values // 32), dtype=np.float32)
    if ggml_type in (Q4_0, Q5_0):
        qs = b[:, -16:]
        q = np.concatenate([qs & 15, qs >> 4], axis=1).astype(np.int64)
        if ggml_type == Q5_0:
            qh = b[:, 2:6].copy().view(np.uint32)
            q |= ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64) << 4
        q -= 16 if ggml_type == Q5_0 else 8
        scales = np.repeat(half(0), 2, axis=1)
    elif ggml_type == Q4_K:
        s = b[:, 4:16].astype(np.int64)
        lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
        sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1)
        mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
        qs = b[:, 16:144].reshape(nb, 4, 32)
        q = np.stack([qs & 15, qs >> 4], axis=2).reshape(nb, 256).astype(np.int64)
        scales = np.repeat((half(0) * sc.astype(np.float32)).astype(np.float32), 2, axis=1)
        mins = -(half(2) * mn.astype(np.float32)).astype(np.float32)
    else:
        ql = b[:, :128].reshape(nb, 2, 64)
        lo4 = np.stack([ql & 15, ql >> 4], axis=2).reshape(nb, 256)
        qh = b[:, 128:192].reshape(nb, 2, 32)
        hi2 = np.stack([(qh >> (2 * i)) & 3 for i in range(4)], axis=2).reshape(nb, 256)
        q = (lo4.astype(np.int64) | (hi2.astype(np.int64) << 4)) - 32
        scales = (half(208) * b[:, 192:208].view(np.int8).astype(np.float32)).astype(np.float32)
    return q.reshape(n, k), scales.reshape(n, k // 16), mins.reshape(n, k // 32)


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    # a*b is exact in float64 for float32 inputs; one float64 add then a float32 rounding equals a
    # single-rounding fma except at astronomically rare double-rounding ties
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def _expected_q8(
    ggml_type: int, x: np.ndarray, q: np.ndarray, scales: np.ndarray, mins: np.ndarray
) -> np.ndarray:
    """The int8-activation kernel's arithmetic: exact integer sums per block (per half block for
    Q6_K, whose scales change every 16 weights), then fma(fl(sum * dx), d, acc) (+ fma(sx, m, acc))."""
    rows, k = x.shape
    nb = k // 32
    xb = x.reshape(rows, nb, 32)
    amax = np.abs(xb).max(axis=2)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    xq = np.clip(np.round(xb * inv[:, :, None]), -127, 127).astype(np.int64)
    dx = (amax / np.float32(127.0)).astype(np.float32)
    sx = (xq.sum(axis=2).astype(np.float32) * dx).astype(np.float32)
    wq = q.reshape(q.shape[0], nb, 32)
    acc = np.zeros((rows, q.shape[0]), dtype=np.float32)
    for b in range(nb):
        parts = [(0, 16, 2 * b), (16, 32, 2 * b + 1)] if ggml_type == Q6_K else [(0, 32, 2 * b)]
        for lo, hi, s in parts:
            isum = xq[:, b, lo:hi] @ wq[:, b, lo:hi].T
            p = (isum.astype(np.float32) * dx[:, b : b + 1]).astype(np.float32)
            acc = _fma(p, scales[None, :, s], acc)
        if ggml_type == Q4_K:
            acc = _fma(np.broadcast_to(sx[:, b : b + 1], acc.shape), mins[None, :, b], acc)
    return acc


def _run(packed: object, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
    out = torch.empty(x.shape[0], packed.n)  # type: ignore[attr-defined]
    packed.forward(x, out, threads)  # type: ignore[attr-defined]
    return out


@pytest.mark.parametrize("ggml_type", TYPES)
def test_codes_model_reproduces_the_loader(ggml_type: int) -> None:
    """The numpy decoding used below gives the dequantizer's values (so the q8 model is about the same weights)."""
    n, k = 19, 512
    raw = _raw(ggml_type, n, k, seed=1)
    q, scales, mins = _codes(ggml_type, raw, n, k)
    w = (q * np.repeat(scales, 16, axis=1)).astype(np.float32) + np.repeat(mins, 32, axis=1)
    assert np.array_equal(w, _DEQUANT[ggml_type](raw).reshape(n, k).numpy())


@pytest.mark.parametrize("ggml_type", TYPES)
def test_packed_weights_equal_the_loader_on_every_isa(ggml_type: int) -> None:
    """Float32 activations: an identity input reads the packed weights back bit for bit."""
    n, k = 37, 512
    raw = _raw(ggml_type, n, k, seed=2)
    w = _DEQUANT[ggml_type](raw).reshape(n, k)
    packed = _native.PackedLinear(raw, ggml_type, n, k)
    for isa in ISAS:
        _native.linear_set_isa(isa)
        assert torch.equal(_run(packed, torch.eye(k), 2), w.T.contiguous()), isa


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("shape", [(16, 256), (45, 512), (133, 768)])
def test_int8_activation_bits_equal_the_numpy_model(ggml_type: int, shape: tuple[int, int]) -> None:
    n, k = shape
    raw = _raw(ggml_type, n, k, seed=n + k)
    packed = _native.PackedLinear(raw, ggml_type, n, k, q8_activations=True)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(3))
    x[3, :32] = 0.0  # an all-zero block: scale 0, every product 0
    x[4, 40] = 1e4  # one outlier block
    want = _expected_q8(ggml_type, x.numpy(), *_codes(ggml_type, raw, n, k))
    for isa in ISAS:
        _native.linear_set_isa(isa)
        for rows in (1, 2, 3, 5, 8, 9, 17, 19):
            got = _run(packed, x[:rows].contiguous(), threads=2).numpy()
            assert np.array_equal(got, want[:rows]), (isa, rows)


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("q8", [False, True])
def test_matmul_within_tolerance_of_the_dequantized_one(ggml_type: int, q8: bool) -> None:
    n, k = 96, 1024
    raw = _raw(ggml_type, n, k, seed=5)
    w = _DEQUANT[ggml_type](raw).reshape(n, k).double()
    packed = _native.PackedLinear(raw, ggml_type, n, k, q8_activations=q8)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(6))
    ref = x.double() @ w.T
    got = _run(packed, x, 2).double()
    if q8:
        assert (got - ref).abs().max().item() <= Q8_RTOL * ref.abs().max().item()
        assert not torch.equal(got, _run(_native.PackedLinear(raw, ggml_type, n, k), x).double())
    else:
        # one k-long float32 FMA chain over the exact weights
        bound = (x.abs().double() @ w.abs().T).max().item()
        assert (got - ref).abs().max().item() <= 1e-5 * bound


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("q8", [False, True])
def test_rows_bit_identical_for_any_batch_and_thread_count(ggml_type: int, q8: bool) -> None:
    n, k = 133, 512  # 9 column groups, the last one partial
    packed = _native.PackedLinear(_raw(ggml_type, n, k, seed=7), ggml_type, n, k, q8_activations=q8)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(8))
    alone = torch.cat([_run(packed, x[r : r + 1].contiguous()) for r in range(x.shape[0])])
    for rows in (2, 4, 7, 8, 9, 16, 17, 37):
        for threads in (1, 2, 3, 16):
            assert torch.equal(_run(packed, x[:rows].contiguous(), threads), alone[:rows]), (rows, threads)
    for start in (0, 5, 11):  # the same row at different offsets of a batch
        assert torch.equal(_run(packed, x[start : start + 20].contiguous(), 2), alone[start : start + 20])


@pytest.mark.parametrize("ggml_type", TYPES)
def test_masked_head_equals_forward(ggml_type: int) -> None:
    n, k = 200, 256
    packed = _native.PackedLinear(_raw(ggml_type, n, k, seed=9), ggml_type, n, k, q8_activations=True)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(9))
    full = _run(packed, x, 2)
    bits = np.zeros((3, (n + 31) // 32), dtype=np.uint32)
    bits[0, 1] = 1  # column 32: group 2
    bits[2, 6] = 1 << 7  # column 199: group 12 (partial)
    out = torch.empty(3, n)
    assert packed.forward_allowed(x, out, torch.from_numpy(bits.view(np.int32).copy()), 2) == 2
    for g in (2, 12):
        cols = slice(16 * g, min(n, 16 * g + 16))
        assert torch.equal(out[:, cols], full[:, cols])
    assert bool(torch.all(out[:, 48:64] == float("-inf")))


def test_k_quant_shape_errors_name_the_block() -> None:
    raw = _raw(Q4_K, 16, 512, seed=0)
    with pytest.raises(ValueError, match=r"k = 384 is not a multiple of the quantization block \(256\)"):
        _native.PackedLinear(raw, Q4_K, 16, 384)
    with pytest.raises(ValueError, match="expected 4608"):
        _native.PackedLinear(raw[:-1], Q4_K, 16, 512)
    raw6 = _raw(Q6_K, 4, 256, seed=0)
    with pytest.raises(ValueError, match="have 840 bytes, expected 1050"):
        _native.PackedLinear(raw6, Q6_K, 5, 256)


@pytest.mark.parametrize("ggml_type", [Q4_0, Q5_0, Q8_0])
def test_q8_0_re_encoding_keeps_every_value(ggml_type: int) -> None:
    """Mixed 32-value types in a fused projection are packed as Q8_0: same dequantized values."""
    n, k = 12, 128
    if ggml_type == Q8_0:
        rng = np.random.default_rng(4)
        d = _f16(rng, 0.001, 0.05, n * k // 32, signed=True)
        codes = rng.integers(0, 256, (n * k // 32, 32), dtype=np.uint8)
        raw = torch.from_numpy(np.concatenate([d, codes], axis=1).reshape(-1).copy())
    else:
        raw = _raw(ggml_type, n, k, seed=4)
    q8 = to_q8_0(raw.view(n, -1), ggml_type)
    assert q8.shape == (n, k // 32 * 34)
    assert torch.equal(_DEQUANT[Q8_0](q8.reshape(-1)), _DEQUANT[ggml_type](raw))
    layer = qlinear.QuantLinear.from_rows([(q8, Q8_0, n)], k, q8_activations=True)
    assert layer.packed.ggml_type == Q8_0
