"""Linear layers over GGUF weights kept packed (Q4_1/Q8_0/...) for the native CPU kernel.

The kernel (``engine_native/src/linear.cpp``) computes every output element with one fixed FMA
chain over ``k``, whatever the batch size or thread, so these layers are batch invariant without
padding rows. Dequantized values equal the torch loader's fp32 values exactly.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from agent_infer import envs
from agent_infer.errors import ModelLoadError
from agent_infer.model.gguf_reader import GGUFFile

# ggml type ids the kernel accepts (F32, F16, Q4_0, Q4_1, Q8_0, BF16)
_NATIVE_TYPES = frozenset({0, 1, 2, 3, 8, 30})
_F32 = 0
# ggml types whose blocks the int8-activation kernel reads (Q4_0, Q4_1, Q8_0)
_QUANTIZED_TYPES = frozenset({2, 3, 8})


_threads: int | None = None


def set_num_threads(n: int | None) -> None:
    """Threads of the native kernel's pool; ``None`` follows ``torch.get_num_threads()``."""
    global _threads
    if n is not None and n < 1:
        raise ValueError(f"native linear threads must be >= 1, got {n}")
    _threads = n


def get_num_threads() -> int:
    """Threads the native kernel uses per call."""
    return _threads if _threads is not None else torch.get_num_threads()


@contextmanager
def thread_budget() -> Iterator[None]:
    """Give the kernel pool torch's thread count and run torch's own ops on one thread meanwhile.

    With the matmuls in the native pool, what torch still runs in a forward (norms, RoPE, per-sequence
    attention) is too small to gain from OpenMP fork/join; measured on 2 cores, one torch thread
    was faster at batch 1 and 16. Restores both settings on exit.
    """
    global _threads
    prev_override, prev_torch = _threads, torch.get_num_threads()
    _threads = get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev_torch)
        _threads = prev_override


def native_linear_available() -> bool:
    """True when the native extension with the packed linear kernel is importable."""
    try:
        from agent_infer import _native
    except ImportError:
        return False
    return hasattr(_native, "PackedLinear")


def use_native_linear(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a GGUF model on ``device``/``dtype`` should keep packed weights (CPU, float32, not disabled)."""
    return (
        device.type == "cpu" and dtype == torch.float32 and envs.native_linear() and native_linear_available()
    )


class PackedWeight(Protocol):
    """What ``_native.PackedLinear`` offers (the extension ships no type stubs)."""

    n: int
    k: int
    ggml_type: int
    nbytes: int
    q8_activations: bool

    def forward(self, x: torch.Tensor, out: torch.Tensor, num_threads: int = 1) -> None:
        """``out = x @ W^T``."""
        ...

    def forward_raw(self, x: int, m: int, out: int, num_threads: int = 1) -> None:
        """``forward`` on raw addresses (``[m, k]`` in, ``[m, n]`` out, float32, contiguous)."""
        ...

    def forward_raw_norm(
        self, x: int, m: int, out: int, weight: int, eps: float, num_threads: int = 1
    ) -> None:
        """``forward_raw`` of ``rms_norm(x) * weight`` (``weight``: ``k`` float32 at that address)."""
        ...

    def forward_allowed(
        self, x: torch.Tensor, out: torch.Tensor, allowed: torch.Tensor, num_threads: int = 1
    ) -> int:
        """``out = x @ W^T`` for the column groups ``allowed`` selects; ``-inf`` elsewhere."""
        ...


class QuantLinear(nn.Module):
    """``y = x @ W^T (+ bias)`` with ``W`` packed in native memory; float32 CPU activations only."""

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.packed = packed
        self.out_features = int(packed.n)
        self.in_features = int(packed.k)
        self.bias = bias

    @classmethod
    def from_rows(
        cls, parts: Sequence[tuple[torch.Tensor, int, int]], k: int, *, q8_activations: bool = False
    ) -> QuantLinear:
        """Pack row blocks ``(raw bytes [rows, row_bytes] uint8, ggml type, rows)`` stacked along N.

        All parts must share one type (callers pass ``force_f32`` to :func:`gguf_rows` for mixed
        files, which is exact), so fusing q/k/v or gate/up never changes a weight value.
        ``q8_activations`` applies to quantized types only (float weights always take float32 x).
        """
        from agent_infer import _native

        types = {t for _, t, _ in parts}
        n = sum(rows for _, _, rows in parts)
        if len(types) == 1 and next(iter(types)) in _NATIVE_TYPES:
            typ = next(iter(types))
            raw = torch.cat([r.reshape(-1) for r, _, _ in parts]).contiguous()
            q8 = q8_activations and typ in _QUANTIZED_TYPES
            return cls(_native.PackedLinear(raw, typ, n, k, q8_activations=q8))
        raise ModelLoadError(f"cannot pack weights of ggml types {sorted(types)} natively")

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> QuantLinear:
        """Pack a float tensor ``[N, K]`` (converted to float32) — for tests and unquantized files."""
        from agent_infer import _native

        w = weight.detach().to(torch.float32).contiguous()
        raw = w.reshape(-1).view(torch.uint8)
        return cls(_native.PackedLinear(raw, _F32, int(w.shape[0]), int(w.shape[1])), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer to ``x`` ``[M, K]`` float32 (made contiguous if needed)."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        self.packed.forward(x, out, get_num_threads())
        if self.bias is not None:
            out += self.bias
        return out

    def _raw_ok(self, x: torch.Tensor) -> bool:
        """Whether ``x`` can go to the kernel as a raw address: float32, CPU, 2-D, contiguous, K wide."""
        return (
            x.dtype is torch.float32
            and x.device.type == "cpu"
            and x.dim() == 2
            and x.shape[1] == self.in_features
            and x.is_contiguous()
        )

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` without ``nn.Module`` dispatch or tensor conversion: the model's hot path.

        A one-token decode step makes ~120 linear calls whose kernels take microseconds; module
        dispatch plus DLPack conversion of two tensors cost ~15 us per call. ``x`` is checked here
        (float32, CPU, 2-D, contiguous, ``in_features`` wide); anything else takes :meth:`forward`.
        """
        if not self._raw_ok(x):
            return self.forward(x)
        m = x.shape[0]
        out = torch.empty(m, self.out_features, dtype=torch.float32)
        self.packed.forward_raw(x.data_ptr(), m, out.data_ptr(), get_num_threads())
        if self.bias is not None:
            out += self.bias
        return out

    def project_normed(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """:meth:`project` of ``rms_norm(x) * weight``, the normalization done in the kernel's call.

        The norm's sum of squares is taken in double in a fixed order (``rms_norm_rows`` in
        linear.cpp), so rows stay batch invariant; its result differs from torch's ``rms_norm`` by
        float rounding. Inputs the fast path cannot take go through torch's norm and :meth:`forward`.
        """
        if not (
            self._raw_ok(x)
            and weight.dtype is torch.float32
            and weight.device.type == "cpu"
            and tuple(weight.shape) == (self.in_features,)
            and weight.is_contiguous()
        ):
            return self.forward(torch.nn.functional.rms_norm(x, (self.in_features,), weight, eps))
        m = x.shape[0]
        out = torch.empty(m, self.out_features, dtype=torch.float32)
        self.packed.forward_raw_norm(
            x.data_ptr(), m, out.data_ptr(), weight.data_ptr(), eps, get_num_threads()
        )
        if self.bias is not None:
            out += self.bias
        return out

    def forward_allowed(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` for the columns a token bitmask can select: only the 16-column groups in
        which some row of ``allowed`` (int32 ``[M, words]``) has a bit set are computed, bit-identical
        to :meth:`forward`; every other column is ``-inf``. The bias must be None."""
        if self.bias is not None:
            raise ValueError("forward_allowed needs a layer without bias")
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        self.packed.forward_allowed(x, out, allowed.contiguous(), get_num_threads())
        return out

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"ggml_type={self.packed.ggml_type}, q8_activations={self.packed.q8_activations}"
        )


def gguf_rows(
    f: GGUFFile, name: str, permute_heads: int | None = None, *, force_f32: bool = False
) -> tuple[torch.Tensor, int, int]:
    """Raw bytes of 2-D GGUF tensor ``name`` as ``[rows, row_bytes]`` (q/k rows un-permuted for RoPE).

    Returns ``(bytes, ggml_type, rows)``; types the kernel cannot read (or all, with ``force_f32``) are
    dequantized to float32 bytes first, which is exact.
    """
    info = f.tensors.get(name)
    if info is None:
        from agent_infer.model.gguf_loader import hf_name

        raise ModelLoadError(f"{f.path}: missing tensors: {hf_name(name) or name} (GGUF {name!r})")
    if len(info.shape) != 2:
        raise ModelLoadError(f"{f.path}: tensor {name!r} has shape {info.shape}, expected 2-D")
    rows = info.shape[0]
    if info.ggml_type in _NATIVE_TYPES and not force_f32:
        raw, typ = f.raw(info).view(rows, -1), info.ggml_type
    else:
        raw, typ = f.dequantize(name).contiguous().view(torch.uint8).view(rows, -1), _F32
    if permute_heads is not None:
        # llama.cpp interleaved each head's two RoPE halves; whole rows move, so blocks stay intact
        raw = raw.reshape(permute_heads, rows // permute_heads // 2, 2, -1).transpose(1, 2).reshape(rows, -1)
    return raw, typ, rows
