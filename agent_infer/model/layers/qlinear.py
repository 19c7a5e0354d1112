"""Linear layers over GGUF weights kept packed (Q4_1/Q8_0/Q4_K/Q6_K/...) for the native CPU kernel.

The kernel (``engine_native/src/kernels/linear.cpp``) computes every output element with one fixed FMA
chain over ``k``, whatever the batch size or thread, so these layers are batch invariant without
padding rows. Dequantized values equal the torch loader's fp32 values exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from agent_infer.errors import ModelLoadError
from agent_infer.model.layers import native_ops
from agent_infer.model.layers.linear import WeightPart
from agent_infer.model.layers.native_ops import PackedWeight, get_num_threads
from agent_infer.model.layers.norm import RMSNorm

# ggml type ids the kernel accepts (F32, F16, Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, BF16)
NATIVE_TYPES = frozenset({0, 1, 2, 3, 6, 8, 12, 14, 30})
F32 = 0
# ggml types whose blocks the int8-activation kernel reads (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)
_QUANTIZED_TYPES = frozenset({2, 3, 6, 8, 12, 14})


def _storage_users(t: torch.Tensor) -> int:
    """References to ``t``'s storage (tensors and views sharing it), or 0 where torch does not say."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return int(count(t.untyped_storage()._cdata)) if count is not None else 0


class QuantLinear(nn.Module):
    """``y = x @ W^T (+ bias)`` with ``W`` packed in native memory; float32 CPU activations only.

    ``parts`` name the checkpoint tensors packed into ``W`` (stacked along N); the bias, when there
    is one, is a float32 parameter loaded by name like any torch tensor.
    """

    row_independent = True
    takes_token_mask = True
    #: :meth:`logits`' reusable output and its storage's use count while only the layer holds it.
    _logits_buffer: torch.Tensor | None = None
    _logits_users = 0

    def __init__(self, packed: PackedWeight, parts: Sequence[WeightPart] = (), *, bias: bool = False) -> None:
        super().__init__()
        self.packed = packed
        self.parts = tuple(parts)
        self.out_features = int(packed.n)
        self.in_features = int(packed.k)
        self.bias = (
            nn.Parameter(torch.empty(self.out_features, dtype=torch.float32), requires_grad=False)
            if bias
            else None
        )

    @classmethod
    def from_rows(
        cls,
        blocks: Sequence[tuple[torch.Tensor, int, int]],
        k: int,
        *,
        q8_activations: bool = False,
        parts: Sequence[WeightPart] = (),
        bias: bool = False,
    ) -> QuantLinear:
        """Pack row blocks ``(raw bytes [rows, row_bytes] uint8, ggml type, rows)`` stacked along N.

        All blocks must share one type (the GGUF packer converts mixed ones to float32, which is
        exact), so fusing q/k/v or gate/up never changes a weight value. ``q8_activations`` applies
        to quantized types only (float weights always take float32 x).
        """
        types = {t for _, t, _ in blocks}
        n = sum(rows for _, _, rows in blocks)
        if len(types) == 1 and next(iter(types)) in NATIVE_TYPES:
            typ = next(iter(types))
            raw = torch.cat([r.reshape(-1) for r, _, _ in blocks]).contiguous()
            q8 = q8_activations and typ in _QUANTIZED_TYPES
            return cls(native_ops.packed_linear(raw, typ, n, k, q8_activations=q8), parts, bias=bias)
        raise ModelLoadError(f"cannot pack weights of ggml types {sorted(types)} natively")

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> QuantLinear:
        """Pack a float tensor ``[N, K]`` (converted to float32) — for tests and unquantized files."""
        w = weight.detach().to(torch.float32).contiguous()
        raw = w.reshape(-1).view(torch.uint8)
        layer = cls(
            native_ops.packed_linear(raw, F32, int(w.shape[0]), int(w.shape[1]), q8_activations=False),
            bias=bias is not None,
        )
        if layer.bias is not None and bias is not None:
            layer.bias.data.copy_(bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the layer to ``x`` ``[M, K]`` float32 (made contiguous if needed)."""
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.out_features, dtype=torch.float32)
        self.packed.forward(x, out, get_num_threads())
        if self.bias is not None:
            out += self.bias
        return out

    def _threads(self, m: int) -> int:
        """Kernel threads for ``m`` rows (every call gets the pool's count here)."""
        return get_num_threads()

    def _raw_ok(self, x: torch.Tensor) -> bool:
        """Whether ``x`` can go to the kernel as a raw address: float32, CPU, 2-D, contiguous, K wide."""
        return (
            x.dtype is torch.float32
            and x.device.type == "cpu"
            and x.dim() == 2
            and x.shape[1] == self.in_features
            and x.is_contiguous()
        )

    def _rows_ok(self, x: torch.Tensor) -> bool:
        """:meth:`_raw_ok` for rows that may lie apart (a column slice of a wider matrix)."""
        return (
            x.dtype is torch.float32
            and x.device.type == "cpu"
            and x.dim() == 2
            and x.shape[1] == self.in_features
            and (x.shape[1] <= 1 or x.stride(1) == 1)
            and x.stride(0) >= self.in_features
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
        self.packed.forward_raw(x.data_ptr(), m, out.data_ptr(), self._threads(m))
        if self.bias is not None:
            out += self.bias
        return out

    def project_normed(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """:meth:`project` of ``norm(x)``, the normalization done in the kernel's call (``x`` may be a
        column slice of a wider matrix: its rows are read where they lie).

        The norm's sum of squares is taken in double in a fixed order (``rms_norm_rows`` in
        linear.cpp), so rows stay batch invariant; its result differs from torch's ``rms_norm`` by
        float rounding. Inputs the fast path cannot take go through torch's norm and :meth:`forward`.
        """
        weight = norm.weight
        if not (
            self._rows_ok(x)
            and weight.dtype is torch.float32
            and weight.device.type == "cpu"
            and tuple(weight.shape) == (self.in_features,)
            and weight.is_contiguous()
        ):
            return self.forward(F.rms_norm(x, (self.in_features,), weight, norm.eps))
        m = x.shape[0]
        out = torch.empty(m, self.out_features, dtype=torch.float32)
        self.packed.forward_raw_norm(
            x.data_ptr(), m, out.data_ptr(), weight.data_ptr(), norm.eps, self._threads(m), int(x.stride(0))
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

    def logits(self, x: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """:meth:`forward` of float32 ``x``, or :meth:`forward_allowed` when given a mask (and no bias).

        Unmasked, the result may be a view of a buffer the layer reuses once nothing else holds the
        previous one (see :meth:`_logits_out`); the values are the same either way.
        """
        x = x.float()
        if allowed is not None and self.bias is None:
            return self.forward_allowed(x, allowed)
        if not self._raw_ok(x):
            return self(x)
        m = int(x.shape[0])
        out = self._logits_out(m)
        self.packed.forward_raw(x.data_ptr(), m, out.data_ptr(), self._threads(m))
        if self.bias is not None:
            out += self.bias
        return out

    def _logits_out(self, m: int) -> torch.Tensor:
        """An ``[m, N]`` float32 output: the layer's buffer when no caller still holds a view of it,
        else a new one (which becomes the buffer).

        A head's logits are a step's largest tensor (8 MB for 16 rows of a 129,280-token vocabulary,
        50 MB for 96 verification rows); freshly mapped memory costs one page fault per 4 KiB
        written, and above glibc's largest mmap threshold (32 MB) every allocation is fresh. The
        buffer keeps the largest output since it was last replaced.
        """
        buf = self._logits_buffer
        if buf is None or int(buf.shape[0]) < m or _storage_users(buf) != self._logits_users:
            buf = torch.empty(m, self.out_features, dtype=torch.float32)
            users = _storage_users(buf)
            # Without a use count (another torch build) no buffer is kept: always a new tensor.
            self._logits_buffer = buf if users > 0 else None
            self._logits_users = users
        return buf[:m]

    def load_targets(self) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]:
        """The bias rows of every part, by HF name (the weights are packed already)."""
        targets: dict[str, tuple[torch.Tensor, int, tuple[int, ...]]] = {}
        if self.bias is None:
            return targets
        row = 0
        for p in self.parts:
            targets[p.name.removesuffix(".weight") + ".bias"] = (self.bias, row, (p.rows,))
            row += p.rows
        return targets

    def packed_names(self) -> frozenset[str]:
        """The HF names of the packed weight tensors."""
        return frozenset(p.name for p in self.parts)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"ggml_type={self.packed.ggml_type}, q8_activations={self.packed.q8_activations}"
        )
