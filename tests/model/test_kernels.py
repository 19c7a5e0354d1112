"""The native packed-weight linear kernel: accuracy against torch and batch invariance by construction.

Weights are built as GGUF blocks (Q4_1, Q8_0, Q4_0, F16, BF16, F32 bytes), dequantized with the
torch loader's own functions for the reference, and packed by ``_native.PackedLinear``.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from agent_infer.model.layers import native_ops, qlinear
from agent_infer.model.layers.kernels import native_kernels_usable
from agent_infer.model.layers.linear import TorchLinear
from agent_infer.model.loading.gguf_reader import _DEQUANT
from agent_infer.native import load_native

# the extension is part of the build: a missing or stale one fails here instead of skipping
_native = load_native()
assert native_ops.available(), f"agent_infer._native lacks a model kernel of {native_ops.MODEL_KERNELS}"

F32, F16, Q4_0, Q4_1, Q8_0, BF16 = 0, 1, 2, 3, 8, 30
TYPES = [Q4_1, Q8_0, Q4_0, F32, F16, BF16]


def _supports(isa: str) -> bool:
    current = _native.linear_isa()
    try:
        _native.linear_set_isa(isa)
    except ValueError:
        return False
    finally:
        _native.linear_set_isa(current)
    return True


ISAS = [isa for isa in ("avx512", "avx2", "scalar") if _supports(isa)]


@pytest.fixture(autouse=True)
def _restore_isa() -> Iterator[None]:
    yield
    _native.linear_set_isa("best")


def _raw(ggml_type: int, n: int, k: int, seed: int) -> torch.Tensor:
    """Random GGUF bytes for an ``[n, k]`` tensor of ``ggml_type`` (scales kept in a realistic range)."""
    rng = np.random.default_rng(seed)
    if ggml_type == F32:
        return torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32)).view(torch.uint8).reshape(-1)
    if ggml_type in (F16, BF16):
        w = torch.from_numpy(rng.standard_normal((n, k)).astype(np.float32))
        return w.to(torch.float16 if ggml_type == F16 else torch.bfloat16).view(torch.uint8).reshape(-1)
    blocks = n * k // 32
    d = (rng.uniform(0.001, 0.05, blocks) * rng.choice([-1, 1], blocks)).astype(np.float16)
    if ggml_type == Q8_0:
        q = rng.integers(-128, 128, (blocks, 32), dtype=np.int8)
        out = np.concatenate([d.view(np.uint8).reshape(blocks, 2), q.view(np.uint8)], axis=1)
    elif ggml_type == Q4_0:
        qs = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
        out = np.concatenate([d.view(np.uint8).reshape(blocks, 2), qs], axis=1)
    else:
        m = rng.uniform(-0.4, 0.1, blocks).astype(np.float16)
        qs = rng.integers(0, 256, (blocks, 16), dtype=np.uint8)
        out = np.concatenate(
            [d.view(np.uint8).reshape(blocks, 2), m.view(np.uint8).reshape(blocks, 2), qs], axis=1
        )
    return torch.from_numpy(np.ascontiguousarray(out)).reshape(-1)


def _layer(ggml_type: int, n: int, k: int, seed: int = 0) -> tuple[object, torch.Tensor]:
    raw = _raw(ggml_type, n, k, seed)
    ref = _DEQUANT[ggml_type](raw).reshape(n, k)
    return _native.PackedLinear(raw, ggml_type, n, k), ref


def _run(packed: object, x: torch.Tensor, threads: int = 1) -> torch.Tensor:
    out = torch.empty(x.shape[0], packed.n)  # type: ignore[attr-defined]
    packed.forward(x, out, threads)  # type: ignore[attr-defined]
    return out


@pytest.mark.parametrize("ggml_type", TYPES)
@pytest.mark.parametrize("shape", [(1, 32), (17, 64), (45, 96), (130, 160)])
def test_matches_torch_reference(ggml_type: int, shape: tuple[int, int]) -> None:
    n, k = shape
    packed, w = _layer(ggml_type, n, k, seed=n + k)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(20, k, generator=gen)
    ref = x.double() @ w.double().T
    bound = (x.abs().double() @ w.abs().double().T).max().item()
    for m in range(1, 21):
        got = _run(packed, x[:m].contiguous(), threads=2)
        # a k-long fp32 FMA chain: error well under 1e-5 of the magnitude of the summed terms
        assert (got.double() - ref[:m]).abs().max().item() <= 1e-5 * bound, m
        torch.testing.assert_close(got, (x[:m] @ w.T), rtol=1e-4, atol=1e-5 * bound)


@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0, F32])
def test_rows_bit_identical_for_any_batch_and_thread_count(ggml_type: int) -> None:
    n, k = 133, 96  # 9 column groups, the last one partial
    packed, _ = _layer(ggml_type, n, k, seed=7)
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([_run(packed, x[r : r + 1].contiguous()) for r in range(x.shape[0])])
    for m in (2, 3, 7, 8, 9, 16, 17, 37):
        for threads in (1, 2, 3, 5, 16):
            got = _run(packed, x[:m].contiguous(), threads)
            assert torch.equal(got, alone[:m]), (m, threads)
    # the same row inside different batches, at different offsets
    for start in (0, 5, 11):
        got = _run(packed, x[start : start + 20].contiguous(), 2)
        assert torch.equal(got, alone[start : start + 20]), start


@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0, F32])
def test_every_isa_gives_identical_bits(ggml_type: int) -> None:
    packed, _ = _layer(ggml_type, 50, 64, seed=11)
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(5))
    results = []
    for isa in ISAS:
        _native.linear_set_isa(isa)
        assert _native.linear_isa() == isa
        results.append(_run(packed, x, 2))
    for r in results[1:]:
        assert torch.equal(r, results[0])


def test_dequantized_values_equal_the_torch_loader() -> None:
    """An identity input reads the packed weights back: they equal the loader's fp32 values exactly."""
    for ggml_type in TYPES:
        packed, w = _layer(ggml_type, 19, 64, seed=2)
        assert torch.equal(_run(packed, torch.eye(64)), w.T.contiguous()), ggml_type


def test_quant_linear_module_and_bias() -> None:
    w = torch.randn(24, 40)
    b = torch.randn(24)
    layer = qlinear.QuantLinear.from_float(w, b)
    x = torch.randn(5, 40)
    torch.testing.assert_close(layer(x), x @ w.T + b, rtol=1e-5, atol=1e-5)
    assert layer(torch.empty(0, 40)).shape == (0, 24)
    # non-contiguous input is made contiguous, not rejected
    xt = torch.randn(40, 5).T
    torch.testing.assert_close(layer(xt), xt @ w.T + b, rtol=1e-5, atol=1e-5)


def test_errors_are_typed_and_clear() -> None:
    packed, _ = _layer(Q4_1, 16, 64)
    with pytest.raises(TypeError, match="x must be float32"):
        packed.forward(torch.zeros(2, 64, dtype=torch.float64), torch.empty(2, 16))  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="out must be float32"):
        packed.forward(torch.zeros(2, 64), torch.empty(2, 16, dtype=torch.float16))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="x has 63 columns, expected 64"):
        packed.forward(torch.zeros(2, 63), torch.empty(2, 16))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"out must be \[2, 16\]"):
        packed.forward(torch.zeros(2, 64), torch.empty(3, 16))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="must be 2-D"):
        packed.forward(torch.zeros(64), torch.empty(1, 16))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="C-contiguous"):
        packed.forward(torch.zeros(64, 2).T, torch.empty(2, 16))  # type: ignore[attr-defined]
    raw = _raw(Q4_1, 16, 64, 0)
    with pytest.raises(ValueError, match="expected 640"):
        _native.PackedLinear(raw[:-1], Q4_1, 16, 64)
    with pytest.raises(ValueError, match="not a multiple of the quantization block"):
        _native.PackedLinear(raw, Q4_1, 20, 48)
    with pytest.raises(ValueError, match="unsupported ggml type 13"):  # Q5_K: dequantized at load instead
        _native.PackedLinear(raw, 13, 16, 64)
    with pytest.raises(TypeError, match="uint8"):
        _native.PackedLinear(raw.view(torch.int8), Q4_1, 16, 64)
    with pytest.raises(ValueError, match="positive"):
        _native.PackedLinear(raw, Q4_1, 0, 64)
    with pytest.raises(ValueError, match="unknown ISA"):
        _native.linear_set_isa("sse9")
    with pytest.raises(ValueError, match=">= 1"):
        native_ops.set_num_threads(0)


def _implementations(model: torch.nn.Module) -> set[type]:
    layer = model.layers[0]  # type: ignore[index]
    linears = (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down, model.lm_head)
    return {type(x) for x in linears} | {type(model.rotary), type(model.attention)}  # type: ignore[attr-defined]


def test_gguf_model_uses_packed_layers_and_can_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader decides once: every projection, the RoPE and the attention of a model come from one path."""
    from agent_infer.model.layers.attention import NativePagedAttention, PagedAttention
    from agent_infer.model.layers.rotary import NativeRotaryEmbedding, RotaryEmbedding
    from agent_infer.model.loader import default_model_path, load_model

    assert native_kernels_usable(torch.device("cpu"), torch.float32)
    assert not native_kernels_usable(torch.device("cpu"), torch.bfloat16)
    lm = load_model(default_model_path(), device=torch.device("cpu"))
    assert lm.model.native and lm.model.masked_head
    assert _implementations(lm.model) == {qlinear.QuantLinear, NativeRotaryEmbedding, NativePagedAttention}
    monkeypatch.setenv("AGENT_INFER_NATIVE_LINEAR", "0")
    assert not native_kernels_usable(torch.device("cpu"), torch.float32)
    lm = load_model(default_model_path(), device=torch.device("cpu"))
    assert not lm.model.native and not lm.model.masked_head
    assert _implementations(lm.model) == {TorchLinear, RotaryEmbedding, PagedAttention}


# --- decode attention -------------------------------------------------------------------------


def _attention_case(
    ctx_lens: list[int], heads: int = 6, kv_heads: int = 2, dim: int = 32, block_size: int = 4, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 3
    k = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen)
    v = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen)
    q = torch.randn(len(ctx_lens), heads, dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, non-monotonic blocks
    width = max(-(-c // block_size) for c in ctx_lens)
    tables = torch.zeros(len(ctx_lens), width, dtype=torch.int64)
    for i, c in enumerate(ctx_lens):
        n = -(-c // block_size)
        tables[i, :n] = torch.tensor([perm.pop() for _ in range(n)])
    return q, k, v, tables, torch.tensor(ctx_lens, dtype=torch.int64)


def _decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    tables: torch.Tensor,
    ctx: torch.Tensor,
    threads: int = 1,
) -> torch.Tensor:
    out = torch.empty(q.shape[0], q.shape[1] * q.shape[2])
    rows = torch.arange(q.shape[0], dtype=torch.int64)
    _native.decode_attention(q, k, v, out, rows, tables, ctx, 4, q.shape[2] ** -0.5, threads)
    return out


@pytest.mark.parametrize("dim", [32, 64, 128, 48, 24])  # 48: generic AVX-512; 24: portable path
def test_decode_attention_matches_sdpa(dim: int) -> None:
    ctx_lens = [1, 5, 16, 17, 64, 301]  # the softmax runs 16 positions at a time, then a tail
    q, k, v, tables, ctx = _attention_case(ctx_lens, dim=dim)
    got = _decode(q, k, v, tables, ctx, threads=2)
    for i, c in enumerate(ctx_lens):
        blocks = tables[i, : -(-c // 4)]
        slots = (blocks[:, None] * 4 + torch.arange(4)).reshape(-1)[:c]
        ks = k[slots].transpose(0, 1)[None]
        vs = v[slots].transpose(0, 1)[None]
        ref = torch.nn.functional.scaled_dot_product_attention(q[i][None, :, None], ks, vs, enable_gqa=True)
        torch.testing.assert_close(got[i], ref.reshape(-1), rtol=1e-5, atol=1e-5)


def test_decode_attention_is_batch_invariant() -> None:
    ctx_lens = [3, 40, 9, 77, 1, 16]
    q, k, v, tables, ctx = _attention_case(ctx_lens, seed=4)
    alone = torch.cat(
        [_decode(q[i : i + 1], k, v, tables[i : i + 1], ctx[i : i + 1]) for i in range(len(ctx_lens))]
    )
    for threads in (1, 2, 3, 8):
        assert torch.equal(_decode(q, k, v, tables, ctx, threads), alone), threads
    # a sub-batch in another order
    order = [4, 1, 3]
    got = _decode(q[order].contiguous(), k, v, tables[order].contiguous(), ctx[order].contiguous(), 2)
    assert torch.equal(got, alone[order])


def test_decode_attention_errors() -> None:
    q, k, v, tables, ctx = _attention_case([5, 9])
    out = torch.empty(2, q.shape[1] * q.shape[2])
    rows = torch.arange(2, dtype=torch.int64)
    with pytest.raises(TypeError, match="q has the wrong dtype"):
        _native.decode_attention(q.double(), k, v, out, rows, tables, ctx, 4, 1.0)
    bad = tables.clone()
    bad[1, 0] = 10_000
    with pytest.raises(IndexError, match="beyond the cache"):
        _native.decode_attention(q, k, v, out, rows, bad, ctx, 4, 1.0)
    with pytest.raises(ValueError, match="context_lens"):
        _native.decode_attention(q, k, v, out, rows, tables, torch.tensor([5, 99]), 4, 1.0)
    with pytest.raises(IndexError, match="rows"):
        _native.decode_attention(q, k, v, out, torch.tensor([0, 2]), tables, ctx, 4, 1.0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        _native.decode_attention(q[:, :5].contiguous(), k, v, torch.empty(2, 160), rows, tables, ctx, 4, 1.0)


def test_pool_survives_back_to_back_calls_of_different_sizes() -> None:
    """Regression: a late worker must not mix one call's generation with another call's chunk count."""
    small, _ = _layer(Q4_1, 16, 64, seed=1)  # one chunk: runs inline
    mid, _ = _layer(Q4_1, 130, 64, seed=2)  # 3 chunks
    big, _ = _layer(Q8_0, 1000, 64, seed=3)  # 16 chunks
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(9))
    want = [_run(layer, x) for layer in (small, mid, big)]
    for i in range(1500):
        layer = (small, mid, big)[i % 3]
        assert torch.equal(_run(layer, x, threads=2 + i % 2), want[i % 3])


@pytest.mark.parametrize("ggml_type", [Q4_1, Q8_0, F32])
def test_forward_allowed_computes_allowed_groups_bit_identically(ggml_type: int) -> None:
    """The masked head: allowed columns equal forward()'s bits, groups no row allows are -inf."""
    n, k = 200, 64  # 13 column groups, the last one partial (8 columns)
    packed, _ = _layer(ggml_type, n, k, seed=13)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(9))
    full = _run(packed, x, 2)
    rng = np.random.default_rng(4)
    words = (n + 31) // 32
    cases = {
        "none": np.zeros((3, words), dtype=np.uint32),
        "one token": np.zeros((3, words), dtype=np.uint32),
        "sparse rows": (rng.random((3, words)) < 0.3) * rng.integers(1, 2**32, (3, words), dtype=np.uint32),
        "all": np.full((3, words), 0xFFFFFFFF, dtype=np.uint32),
        "short mask": np.full((3, 2), 0xFFFFFFFF, dtype=np.uint32),  # columns past 64 disallowed
    }
    cases["one token"][1, 3] = 1 << 20  # column 116: group 7 only
    for name, bits in cases.items():
        allowed = torch.from_numpy(bits.view(np.int32).copy())
        for threads in (1, 2, 3):
            out = torch.empty(3, n)
            computed = packed.forward_allowed(x, out, allowed, threads)  # type: ignore[attr-defined]
            union = np.bitwise_or.reduce(bits, axis=0)
            need = [
                g // 2 < union.shape[0] and (int(union[g // 2]) >> (16 * (g % 2))) & 0xFFFF != 0
                for g in range((n + 15) // 16)
            ]
            assert computed == sum(need), name
            for g, needed in enumerate(need):
                cols = slice(16 * g, min(n, 16 * g + 16))
                if needed:
                    assert torch.equal(out[:, cols], full[:, cols]), (name, g)
                else:
                    assert bool(torch.all(out[:, cols] == float("-inf"))), (name, g)


def test_forward_allowed_errors() -> None:
    packed, _ = _layer(Q8_0, 64, 32)
    x = torch.randn(2, 32)
    out = torch.empty(2, 64)
    with pytest.raises(ValueError, match="int32"):
        packed.forward_allowed(x, out, torch.zeros(2, 2, dtype=torch.int64))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="rows"):
        packed.forward_allowed(x, out, torch.zeros(3, 2, dtype=torch.int32))  # type: ignore[attr-defined]
    layer = qlinear.QuantLinear.from_float(torch.randn(8, 32), torch.randn(8))
    with pytest.raises(ValueError, match="bias"):
        layer.forward_allowed(x, torch.zeros(2, 1, dtype=torch.int32))


def test_project_fast_path_equals_forward() -> None:
    """QuantLinear.project (raw addresses, no module dispatch) gives forward()'s bits, bias included,
    and routes inputs it cannot pass raw (non-contiguous, other dtypes) through forward()."""
    w, b = torch.randn(40, 64), torch.randn(40)
    layer = qlinear.QuantLinear.from_float(w, b)
    x = torch.randn(7, 64)
    assert torch.equal(layer.project(x), layer(x))
    xt = torch.randn(64, 7).T  # non-contiguous
    assert torch.equal(layer.project(xt), layer(xt.contiguous()))
    assert layer.project(torch.empty(0, 64)).shape == (0, 40)
    with pytest.raises(TypeError):
        layer.project(x.double())


def test_logits_reuse_a_buffer_only_when_no_result_is_held() -> None:
    """QuantLinear.logits equals forward() (masked: forward_allowed), reuses its output buffer once the
    previous result is dropped, and never overwrites a result (or a view of one) a caller holds."""
    layer = qlinear.QuantLinear.from_float(torch.randn(40, 64), torch.randn(40))
    x = torch.randn(7, 64)
    first = layer.logits(x, None)
    assert torch.equal(first, layer(x))
    second = layer.logits(2 * x, None)  # `first` is held: a new tensor
    assert torch.equal(first, layer(x)) and torch.equal(second, layer(2 * x))
    address = second.data_ptr()
    del first, second
    third = layer.logits(x[:3], None)
    assert third.data_ptr() == address and torch.equal(third, layer(x[:3]))
    row = third[1]
    del third
    fourth = layer.logits(x, None)
    assert fourth.data_ptr() != row.data_ptr() and torch.equal(row, layer(x[1:2])[0])
    plain = qlinear.QuantLinear.from_float(torch.randn(40, 64))
    allowed = torch.zeros(7, 2, dtype=torch.int32)
    allowed[:, 0] = 1 << 3  # token 3 only: its 16-column group is computed, the other is -inf
    masked = plain.logits(x, allowed)
    assert torch.equal(masked[:, :16], plain(x)[:, :16]) and bool((masked[:, 16:] == float("-inf")).all())


def test_decode_batch_runs_the_same_kernel_on_raw_addresses() -> None:
    """DecodeBatch (checked once per forward, run per layer on addresses) gives decode_attention's bits."""
    ctx_lens = [3, 40, 9, 77, 1, 16]
    q, k, v, tables, ctx = _attention_case(ctx_lens, seed=6)
    rows = torch.arange(len(ctx_lens), dtype=torch.int64)
    batch = _native.DecodeBatch(rows, tables, ctx, 4, q.shape[0], k.shape[0])
    for threads in (1, 2, 3):
        out = torch.empty(q.shape[0], q.shape[1] * q.shape[2])
        batch.run(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), q.shape[1], k.shape[1],
                  q.shape[2], q.shape[2] ** -0.5, threads)  # fmt: skip
        assert torch.equal(out, _decode(q, k, v, tables, ctx, threads)), threads
    bad = tables.clone()
    bad[1, 0] = 10_000
    with pytest.raises(IndexError, match="beyond the cache"):
        _native.DecodeBatch(rows, bad, ctx, 4, q.shape[0], k.shape[0])
    with pytest.raises(IndexError, match="rows"):
        _native.DecodeBatch(rows, tables, ctx, 4, 3, k.shape[0])
    with pytest.raises(ValueError, match="multiple of kv heads"):
        batch.run(q.data_ptr(), k.data_ptr(), v.data_ptr(), q.data_ptr(), 5, k.shape[1], q.shape[2], 1.0)
