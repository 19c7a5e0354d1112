"""Mask-apply backends against the torch reference, bit for bit (CPU here; Triton and CUDA where CUDA exists)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from agent_infer.errors import AcceleratorUnavailableError, ConfigError, TokenBitmaskError
from agent_infer.grammar.runtime.bitmask import (
    allocate_token_bitmask,
    apply_token_bitmask_inplace,
    apply_token_bitmask_inplace_torch,
    bitmask_words,
    select_backend,
)
from agent_infer.grammar.runtime.kernels import available, backend_module

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
NO_CUDA = "needs an NVIDIA GPU (torch.cuda.is_available() is False on this machine)"

# (vocab of the logits, words in the bitmask): the two real vocabularies, odd sizes, and masks
# narrower (tokens past 32 * words must be masked) and wider (extra bits ignored) than the logits.
SHAPES = [
    (49152, bitmask_words(49152)),
    (129280, bitmask_words(129280)),
    (1000, bitmask_words(1000)),
    (33, 2),
    (31, 1),
    (1000, 20),  # 640 bits for 1000 logits
    (700, 40),  # 1280 bits for 700 logits
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def random_mask(rows: int, words: int, seed: int) -> torch.Tensor:
    """Random words mixed with the structured cases real grammars give: all-ones, all-zero, sparse rows."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.randint(-(2**31), 2**31, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
    if rows > 1:
        mask[1] = -1
    if rows > 2:
        mask[2] = 0
    if rows > 3:  # a sparse row: a handful of allowed tokens, the typical constrained step
        mask[3] = 0
        cols = torch.randint(0, words, (5,), generator=g)
        mask[3, cols] = torch.tensor([1, 1 << 7, 1 << 31, 3, -(2**31)], dtype=torch.int64).to(torch.int32)
    return mask


def random_logits(rows: int, vocab: int, dtype: torch.dtype, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((rows, vocab), generator=g).to(dtype=dtype, device=device)


def numpy_reference(logits: np.ndarray, mask: np.ndarray, rows: list[int]) -> np.ndarray:
    """An independent reference (unpacked bits, little-endian within each word) for the torch one."""
    out = logits.copy()
    vocab = out.shape[1]
    for r in rows:
        bits = np.unpackbits(mask[r].astype("<i4").view(np.uint8), bitorder="little").astype(bool)
        allowed = np.zeros(vocab, dtype=bool)
        n = min(vocab, bits.size)
        allowed[:n] = bits[:n]
        out[r, ~allowed] = -np.inf
    return out


@pytest.mark.parametrize(("vocab", "words"), [(49152, 1536), (1000, 20), (700, 40), (33, 2)])
@pytest.mark.parametrize("with_indices", [False, True])
def test_torch_reference_matches_numpy(vocab: int, words: int, with_indices: bool) -> None:
    rows = 6
    logits = random_logits(rows, vocab, torch.float32, seed=vocab)
    mask = random_mask(rows, words, seed=words)
    selected = [4, 1, 3] if with_indices else list(range(rows))
    expected = numpy_reference(logits.numpy(), mask.numpy(), selected)
    apply_token_bitmask_inplace_torch(logits, mask, selected if with_indices else None)
    assert np.array_equal(logits.numpy(), expected)


def run_backend(
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
    vocab: int,
    words: int,
    dtype: torch.dtype,
    indices: str,
    device: str = "cpu",
) -> None:
    """Mask the same random logits with ``backend`` (forced) and with the reference; demand equality."""
    rows = 8
    logits = random_logits(rows, vocab, dtype, seed=vocab + words, device=device)
    mask = random_mask(rows, words, seed=words).to(device)
    chosen: list[int] | torch.Tensor | None
    if indices == "none":
        chosen = None
    elif indices == "list":
        chosen = [6, 0, 3, 2]
    else:  # a tensor on the logits' device, with a repeated row
        chosen = torch.tensor([7, 1, 3, 1, 5], dtype=torch.int64, device=device)
    expected = logits.clone()
    apply_token_bitmask_inplace_torch(expected, mask, chosen)
    monkeypatch.setenv("AGENT_INFER_MASK_BACKEND", backend)
    got = logits.clone()
    apply_token_bitmask_inplace(got, mask, chosen)
    assert torch.equal(got, expected), f"{backend} differs from the reference"
    untouched = set(range(rows)) - set(range(rows) if chosen is None else [int(i) for i in chosen])
    for r in untouched:
        assert torch.equal(got[r], logits[r]), f"row {r} was not selected but changed"


@pytest.mark.parametrize(("vocab", "words"), SHAPES)
@pytest.mark.parametrize("indices", ["none", "list", "tensor"])
def test_cpu_kernel_matches_reference(
    vocab: int, words: int, indices: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_backend("cpu", monkeypatch, vocab, words, torch.float32, indices)


@pytest.mark.parametrize(("vocab", "words"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("indices", ["none", "tensor"])
def test_auto_dispatch_matches_reference(
    vocab: int, words: int, dtype: torch.dtype, indices: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_backend("auto", monkeypatch, vocab, words, dtype, indices)


def test_one_dimensional_logits_and_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    for backend in ("cpu", "torch", "auto"):
        monkeypatch.setenv("AGENT_INFER_MASK_BACKEND", backend)
        logits = random_logits(1, 100, torch.float32, seed=1)[0]
        mask = random_mask(1, 4, seed=2)[0]
        expected = torch.from_numpy(numpy_reference(logits[None].numpy(), mask[None].numpy(), [0])[0])
        apply_token_bitmask_inplace(logits, mask)
        assert torch.equal(logits, expected)
        again = random_logits(1, 100, torch.float32, seed=1)[0]
        apply_token_bitmask_inplace(again, mask, [0])
        assert torch.equal(again, expected)


@pytest.mark.parametrize(
    ("backend", "dtype"), [("cpu", torch.float32), ("torch", torch.float32), ("auto", torch.bfloat16)]
)
def test_inference_tensors_outside_inference_mode(
    backend: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine's logits come out of inference_mode and are masked after it has exited.
    monkeypatch.setenv("AGENT_INFER_MASK_BACKEND", backend)
    with torch.inference_mode():
        logits = random_logits(4, 300, dtype, seed=6)
    mask = random_mask(4, 10, seed=6)
    expected = logits.clone()
    with torch.inference_mode():
        apply_token_bitmask_inplace_torch(expected, mask, [1, 2])
    apply_token_bitmask_inplace(logits, mask, [1, 2])
    assert torch.equal(logits, expected)
    apply_token_bitmask_inplace(logits, mask)
    assert torch.isinf(logits).any()


def test_all_ones_mask_changes_nothing_and_empty_indices_are_a_no_op() -> None:
    logits = random_logits(3, 200, torch.float32, seed=3)
    before = logits.clone()
    apply_token_bitmask_inplace(logits, allocate_token_bitmask(3, 200))
    apply_token_bitmask_inplace(logits, torch.zeros(3, 7, dtype=torch.int32), [])
    apply_token_bitmask_inplace(
        logits, torch.zeros(3, 7, dtype=torch.int32), torch.empty(0, dtype=torch.int64)
    )
    assert torch.equal(logits, before)


def test_non_contiguous_logits_use_the_reference() -> None:
    base = random_logits(4, 300, torch.float32, seed=4)
    view = base[:, ::2]  # stride 2 in the vocabulary dimension
    assert select_backend(view) == "torch"
    mask = random_mask(4, 5, seed=5)
    expected = view.clone()
    apply_token_bitmask_inplace_torch(expected, mask)
    apply_token_bitmask_inplace(view, mask)
    assert torch.equal(view, expected) and torch.equal(base[:, ::2], expected)


def test_selection_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENT_INFER_MASK_BACKEND", raising=False)
    assert select_backend(torch.zeros(2, 64)) == "cpu"
    assert select_backend(torch.zeros(2, 64, dtype=torch.bfloat16)) == "torch"
    assert select_backend(torch.zeros(2, 64, dtype=torch.float64)) == "torch"
    monkeypatch.setenv("AGENT_INFER_MASK_BACKEND", "torch")
    assert select_backend(torch.zeros(2, 64)) == "torch"
    assert available("cpu", torch.device("cpu")) and available("torch", torch.device("cpu"))
    assert not available("triton", torch.device("cpu")) and not available("cuda", torch.device("cpu"))


def test_bad_arguments_raise_typed_errors_naming_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = torch.zeros(4, 64)
    mask = allocate_token_bitmask(4, 64)
    with pytest.raises(TokenBitmaskError, match=r"3 rows but logits have 4.*\(4, 64\).*\(3, 2\)"):
        apply_token_bitmask_inplace(logits, allocate_token_bitmask(3, 64))
    with pytest.raises(TokenBitmaskError, match="int32"):
        apply_token_bitmask_inplace(logits, mask.to(torch.int64))
    with pytest.raises(TokenBitmaskError, match="floating"):
        apply_token_bitmask_inplace(torch.zeros(4, 64, dtype=torch.int32), mask)
    with pytest.raises(TokenBitmaskError, match="1-D or 2-D"):
        apply_token_bitmask_inplace(torch.zeros(2, 2, 64), mask)
    with pytest.raises(TokenBitmaskError, match=r"indices\[1\] = 4 is outside the 4 rows"):
        apply_token_bitmask_inplace(logits, mask, [0, 4])
    with pytest.raises(TokenBitmaskError, match="contain -1"):
        apply_token_bitmask_inplace(logits, mask, torch.tensor([-1, 2]))
    with pytest.raises(TokenBitmaskError, match="not an int"):
        apply_token_bitmask_inplace(logits, mask, [0.0])  # type: ignore[list-item]
    with pytest.raises(TokenBitmaskError, match="integers"):
        apply_token_bitmask_inplace(logits, mask, torch.tensor([True, False]))
    # Rows of a shorter bitmask bound the indices too.
    with pytest.raises(TokenBitmaskError, match="outside the 2 rows"):
        apply_token_bitmask_inplace(logits, allocate_token_bitmask(2, 64), [3])
    monkeypatch.setenv("AGENT_INFER_MASK_BACKEND", "cpu")
    with pytest.raises(TokenBitmaskError, match=r"does not support torch\.float16"):
        apply_token_bitmask_inplace(logits.half(), mask)
    monkeypatch.setenv("AGENT_INFER_MASK_BACKEND", "triton")
    with pytest.raises(AcceleratorUnavailableError, match="triton cannot run on cpu"):
        apply_token_bitmask_inplace(logits, mask)
    monkeypatch.setenv("AGENT_INFER_MASK_BACKEND", "fast")
    with pytest.raises(ConfigError, match="AGENT_INFER_MASK_BACKEND='fast'"):
        apply_token_bitmask_inplace(logits, mask)
    with pytest.raises(ConfigError, match="unknown mask backend"):
        backend_module("fast")


@pytest.mark.skipif(not HAS_TRITON or HAS_CUDA, reason="needs triton installed on a machine without a GPU")
def test_auto_mode_falls_back_when_a_gpu_backend_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pretend Triton is the best backend for CPU tensors: without a GPU (or its interpreter) its
    # launch fails, so auto mode must warn, disable it for the process and still mask correctly.
    import agent_infer.grammar.runtime.bitmask as bitmask_module

    monkeypatch.delenv("AGENT_INFER_MASK_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(bitmask_module, "_candidates", lambda logits: ("triton", "torch"))
    monkeypatch.setattr(bitmask_module, "_broken", {})
    monkeypatch.setitem(bitmask_module._available, ("triton", "cpu"), True)
    logits = random_logits(3, 100, torch.float16, seed=8)
    mask = random_mask(3, 4, seed=8)
    expected = logits.clone()
    apply_token_bitmask_inplace_torch(expected, mask)
    with pytest.warns(RuntimeWarning, match="mask backend 'triton' failed on cpu"):
        apply_token_bitmask_inplace(logits, mask)
    assert torch.equal(logits, expected)
    assert ("triton", "cpu") in bitmask_module._broken
    assert select_backend(logits) == "torch"


def test_importing_the_package_imports_no_gpu_backend() -> None:
    code = textwrap.dedent(
        """
        import sys, torch
        import agent_infer
        from agent_infer.grammar import apply_token_bitmask_inplace, allocate_token_bitmask
        apply_token_bitmask_inplace(torch.zeros(2, 40), allocate_token_bitmask(2, 40))
        apply_token_bitmask_inplace(torch.zeros(2, 40, dtype=torch.bfloat16), allocate_token_bitmask(2, 40))
        print([m for m in ("triton", "agent_infer.grammar.runtime.kernels.triton", "agent_infer.grammar.runtime.kernels.cuda")
               if m in sys.modules])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# --- Triton in its CPU interpreter ---------------------------------------------------------------

INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from agent_infer.grammar.runtime.kernels import triton as backend
    from agent_infer.grammar.runtime.bitmask import apply_token_bitmask_inplace_torch
    cases = json.loads(sys.argv[1])
    results = []
    for vocab, words, dtype_name, with_indices in cases:
        dtype = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(vocab * 7 + words)
        rows = 4
        logits = torch.randn((rows, vocab), generator=g).to(dtype)
        mask = torch.randint(-(2**31), 2**31, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)
        mask[1] = 0
        idx = torch.tensor([3, 1, 3], dtype=torch.int64) if with_indices else None
        expected = logits.clone()
        apply_token_bitmask_inplace_torch(expected, mask, idx)
        got = logits.clone()
        backend.apply(got, mask, idx)
        results.append(bool(torch.equal(got, expected)))
    print(json.dumps(results))
    """
)


def _interpreter_dtypes() -> tuple[str, ...]:
    """bfloat16 only where Triton's interpreter can build bf16 constants (3.6 cannot; 3.9 can)."""
    from triton.runtime.interpreter import InterpreterBuilder

    bf16 = hasattr(InterpreterBuilder, "get_bf16")
    return ("float32", "float16", "bfloat16") if bf16 else ("float32", "float16")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_triton_kernel_in_the_cpu_interpreter() -> None:
    cases = [
        [vocab, words, dtype, with_indices]
        for vocab, words in [(49152, 1536), (1000, 32), (33, 2), (1000, 20), (700, 40)]
        for dtype in _interpreter_dtypes()
        for with_indices in (False, True)
    ]
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run(
        [sys.executable, "-c", INTERPRETER_SCRIPT, json.dumps(cases)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads(out.stdout.strip().splitlines()[-1])
    failed = [case for case, ok in zip(cases, results) if not ok]
    assert len(results) == len(cases) and not failed, f"Triton (interpreted) differs from torch on {failed}"


# --- NVIDIA: run where CUDA exists ---------------------------------------------------------------

GPU_BACKENDS = [
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")),
    "cuda",
    "torch",
]


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize(("vocab", "words"), SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("indices", ["none", "list", "tensor"])
def test_gpu_backend_matches_reference(
    backend: str, vocab: int, words: int, dtype: torch.dtype, indices: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_backend(backend, monkeypatch, vocab, words, dtype, indices, device="cuda")


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
def test_gpu_auto_dispatch_and_host_bitmask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENT_INFER_MASK_BACKEND", raising=False)
    logits = random_logits(8, 49152, torch.bfloat16, seed=9, device="cuda")
    expected_backend = "triton" if HAS_TRITON else "cuda"
    assert select_backend(logits) == expected_backend
    mask = random_mask(8, 1536, seed=9)  # on the host: moved to the GPU by the call
    expected = logits.clone()
    apply_token_bitmask_inplace_torch(expected, mask.cuda(), [5, 2])
    apply_token_bitmask_inplace(logits, mask, [5, 2])
    assert torch.equal(logits, expected)


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_inference_tensors_outside_inference_mode(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_INFER_MASK_BACKEND", backend)
    with torch.inference_mode():
        logits = random_logits(4, 1000, torch.bfloat16, seed=7, device="cuda")
    mask = random_mask(4, 32, seed=7).cuda()
    expected = logits.clone()
    with torch.inference_mode():
        apply_token_bitmask_inplace_torch(expected, mask, [3, 0])
    apply_token_bitmask_inplace(logits, mask, torch.tensor([3, 0], device="cuda"))
    assert torch.equal(logits, expected)


@pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA)
def test_gpu_device_indices_out_of_range_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    # Device indices are not checked on the host (that would sync); the kernels must not write outside.
    for backend in ("triton", "cuda") if HAS_TRITON else ("cuda",):
        monkeypatch.setenv("AGENT_INFER_MASK_BACKEND", backend)
        logits = random_logits(2, 64, torch.float32, seed=1, device="cuda")
        before = logits.clone()
        apply_token_bitmask_inplace(
            logits, torch.zeros(2, 2, dtype=torch.int32), torch.tensor([5], device="cuda")
        )
        torch.cuda.synchronize()
        assert torch.equal(logits, before)
