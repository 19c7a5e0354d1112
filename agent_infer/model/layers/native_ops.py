"""The model's typed door to the C++ extension: with its DeepSeek part (:mod:`.native_deepseek`), the
only model code that touches ``agent_infer._native``.

The kernels here (``engine_native/src/``: linear, attention, rope) take raw addresses on their hot entry points, so
every wrapper documents the shapes and dtypes its caller must have checked. :func:`available` is
the load-time question "can this process run the native path at all"; the loader asks it once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Protocol

import torch

from agent_infer.errors import NativeExtensionMissingError
from agent_infer.native import load_native

#: Extension attributes the native model path needs; a build without any of them takes the torch path.
MODEL_KERNELS = ("PackedLinear", "PackedExperts", "decode_attention", "DecodeBatch", "rope_rows")

_ext: ModuleType | None = None


def extension() -> ModuleType:
    """The loaded extension module (loaded on first use; raises ``NativeExtensionMissingError``)."""
    global _ext
    if _ext is None:
        _ext = load_native()
    return _ext


def available() -> bool:
    """True when the extension loads and has every model kernel (:data:`MODEL_KERNELS`)."""
    try:
        ext = extension()
    except NativeExtensionMissingError:
        return False
    return all(hasattr(ext, name) for name in MODEL_KERNELS)


# --- threads -----------------------------------------------------------------------------------

_threads: int | None = None


def set_num_threads(n: int | None) -> None:
    """Threads of the native kernels' pool; ``None`` follows ``torch.get_num_threads()``."""
    global _threads
    if n is not None and n < 1:
        raise ValueError(f"native linear threads must be >= 1, got {n}")
    _threads = n


def get_num_threads() -> int:
    """Threads the native kernels use per call."""
    return _threads if _threads is not None else torch.get_num_threads()


#: Multiply-adds below which a DeepSeek packed-float kernel call (a projection, the MoE experts, a
#: hyper-connection, a grouped projection, decode attention, window closes) runs on the calling
#: thread alone (~25 us on one core):
#: waking the pool costs about as much as it saves there, and a woken worker spins between the
#: many small calls of a decode step, which shows as CPU time (and as wall time on a busy machine).
PARALLEL_MIN_WORK = 1 << 20


def threads_for(work: int) -> int:
    """:func:`get_num_threads` for a kernel call of ``work`` multiply-adds; 1 below
    :data:`PARALLEL_MIN_WORK`. The thread count never changes a kernel's results."""
    return get_num_threads() if work >= PARALLEL_MIN_WORK else 1


@contextmanager
def thread_budget() -> Iterator[None]:
    """Give the kernel pool torch's thread count and run torch's own ops on one thread meanwhile.

    With the matmuls in the native pool, what torch still runs in a forward (norms, per-sequence
    SDPA) is too small to gain from OpenMP fork/join: one torch thread is faster at batch 1 and 16
    on 2 cores. Restores both settings on exit.
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


# --- argmax --------------------------------------------------------------------------------------

_argmax: bool | None = None


def argmax_rows(x: torch.Tensor) -> list[int]:
    """``x.argmax(dim=-1).tolist()`` of a 2-D tensor (the same indices, NaN rule included); float32
    CPU C-contiguous rows take the native scan (kernels/argmax.cpp), anything else torch's."""
    global _argmax
    if _argmax is None:
        _argmax = available() and hasattr(extension(), "argmax_rows")
    native = _argmax and x.dtype is torch.float32 and x.device.type == "cpu" and x.dim() == 2
    if native and x.is_contiguous() and int(x.shape[0]) and int(x.shape[1]):
        rows: list[int] = extension().argmax_rows(x, get_num_threads())
        return rows
    result: list[int] = x.argmax(dim=-1).tolist()
    return result


# --- packed linear -----------------------------------------------------------------------------


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

    def forward_raw(self, x: int, m: int, out: int, num_threads: int = 1, ldx: int = 0, ldy: int = 0) -> None:
        """``forward`` on raw addresses (``[m, k]`` in, ``[m, n]`` out, float32; rows ``ldx`` and
        ``ldy`` floats apart, 0 for contiguous)."""
        ...

    def forward_raw_norm(
        self, x: int, m: int, out: int, weight: int, eps: float, num_threads: int = 1, ldx: int = 0
    ) -> None:
        """``forward_raw`` of ``rms_norm(x) * weight`` (``weight``: ``k`` float32 at that address;
        rows of ``x`` ``ldx`` floats apart, 0 for ``k``)."""
        ...

    def forward_allowed(
        self, x: torch.Tensor, out: torch.Tensor, allowed: torch.Tensor, num_threads: int = 1
    ) -> int:
        """``out = x @ W^T`` for the column groups ``allowed`` selects; ``-inf`` elsewhere."""
        ...

    def unpack_raw(self, out: int) -> None:
        """The weights ``[n, k]`` of a float layer as float32 rows at address ``out``."""
        ...


def packed_linear(raw: torch.Tensor, ggml_type: int, n: int, k: int, *, q8_activations: bool) -> PackedWeight:
    """Pack ``raw`` (uint8 bytes of ``n`` rows of ``k`` weights of ``ggml_type``) for the linear kernel."""
    packed: PackedWeight = extension().PackedLinear(raw, ggml_type, n, k, q8_activations=q8_activations)
    return packed


def unpack_float(packed: PackedWeight) -> torch.Tensor:
    """A float layer's weights ``[n, k]`` back as float32: exactly the values it was packed from."""
    out = torch.empty(packed.n, packed.k, dtype=torch.float32)
    packed.unpack_raw(out.data_ptr())
    return out


# --- attention ---------------------------------------------------------------------------------


class DecodeBatch(Protocol):
    """What ``_native.DecodeBatch`` offers: decode rows checked once, then run per layer on raw addresses."""

    def run(
        self, q: int, k_cache: int, v_cache: int, out: int, heads: int, kv_heads: int, dim: int,
        scale: float, num_threads: int,
    ) -> None:  # fmt: skip
        """Attend every row of the batch (q ``[R, heads, dim]``, caches ``[num_slots, kv_heads, dim]``)."""
        ...

    def run_mla(
        self, q_nope: int, q_rope: int, cache: int, kv_b: int, out: int, heads: int, nope: int, rope: int,
        lora: int, v: int, scale: float, num_threads: int, qn_row: int, qn_head: int, qr_row: int, qr_head: int,
    ) -> None:  # fmt: skip
        """Multi-head latent attention decode, weight-absorbed, for every row of the batch (q_nope
        and q_rope rows and heads at the given strides, latent cache ``[num_slots, lora + rope]``,
        kv_b ``[heads * (nope + v), lora]``, out ``[R, heads * v]``)."""
        ...


def decode_batch(
    rows: torch.Tensor, tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, num_tokens: int,
    num_slots: int, table_rows: torch.Tensor | None = None,
) -> DecodeBatch:  # fmt: skip
    """Check decode rows once (rows below ``num_tokens``, blocks inside ``num_slots``) for every layer's call.

    Entry ``i`` uses row ``table_rows[i]`` of ``tables`` (None: row ``i``), so a long chunk's rows
    can share one table.
    """
    batch: DecodeBatch = extension().DecodeBatch(
        rows, tables, context_lens, block_size, num_tokens, num_slots, table_rows
    )
    return batch


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, rows: torch.Tensor,
    tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, scale: float, num_threads: int,
) -> None:  # fmt: skip
    """The checking entry point of decode attention: anything unexpected raises a typed error."""
    extension().decode_attention(
        q, k_cache, v_cache, out, rows, tables, context_lens, block_size, scale, num_threads
    )


# --- rotary ------------------------------------------------------------------------------------


def rope_rows(
    qkv: torch.Tensor, qk_heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor
) -> None:
    """Rotate the first ``qk_heads`` heads of each row of ``qkv`` in place by the tables at ``pos``.

    The caller guarantees contiguous float32 CPU ``qkv`` ``[rows, width]``, tables
    ``[max_positions, dim/2]`` and int64 ``pos`` with at least ``rows`` entries; the kernel checks
    each position against the table length.
    """
    extension().rope_rows(
        qkv.data_ptr(), int(qkv.shape[0]), int(qkv.shape[1]), qk_heads, dim, cos.data_ptr(), sin.data_ptr(),
        int(cos.shape[0]), pos.data_ptr(),
    )  # fmt: skip
