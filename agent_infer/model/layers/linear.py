"""Linear layers: the torch implementation, the interface the packed native one shares, and their builders.

A family builds every projection through a :class:`LinearBuilder` the loader picked, so the class
of each layer (:class:`TorchLinear` or :class:`~agent_infer.model.layers.qlinear.QuantLinear`) is
decided once, at load time, and the forward pass calls the same methods on either.

Batch invariance on the torch path: MKL's sgemm (and oneDNN's bf16 gemm) gives a row bit-identical
results for any row count that is a multiple of 4 on some CPUs (1-3 rows, or a 1-3 row tail split
off to a thread, take other kernels), but not on all: on a Xeon with AMX, 13-16 rows and more take
other kernels again. So the torch path pads a forward's rows to a multiple of :data:`ROW_MULTIPLE`
and runs every matmul on the CPU in chunks of exactly that many rows: one kernel shape for every
row, whatever the batch. On GPUs this is not known to suffice (cuBLAS picks kernels by shape) and
invariance is untested there. The padding costs about 40% of batch-1 decode matmul time on the CPU
(4 rows instead of 1), which is why GGUF models on the CPU take the packed native kernel instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from agent_infer.model.layers.norm import RMSNorm

ROW_MULTIPLE = 4


def pad_rows(n: int, multiple: int = ROW_MULTIPLE) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


def in_row_chunks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` (row-wise) over ``x`` in chunks of ROW_MULTIPLE rows on the CPU: one GEMM shape for
    every row, so a row's bits cannot depend on how many rows share the call."""
    n = int(x.shape[0])
    if x.device.type != "cpu" or n <= ROW_MULTIPLE:
        return fn(x)
    return torch.cat([fn(x[i : i + ROW_MULTIPLE]) for i in range(0, n, ROW_MULTIPLE)])


def row_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` over ``x`` padded to a multiple of ROW_MULTIPLE rows and run in chunks, for callers
    whose row count is not already padded (the LM head, a MoE expert's tokens)."""
    m = int(x.shape[0])
    rows = pad_rows(m)
    if rows > m:
        x = torch.cat((x, x.new_zeros(rows - m, *x.shape[1:])))
    return in_row_chunks(fn, x)[:m]


@dataclass(frozen=True)
class WeightPart:
    """One checkpoint tensor of a (possibly fused) projection: its HF name and its output rows.

    ``rope_heads`` is set on q/k projections whose rows GGUF files of some architectures store
    permuted for an interleaved RoPE (the packed builder un-permutes them; see loading/gguf.py).
    """

    name: str
    rows: int
    rope_heads: int | None = None


class Linear(Protocol):
    """``y = x @ W^T (+ bias)`` over ``[M, in_features]`` rows, whichever kernel holds ``W``."""

    in_features: int
    out_features: int
    #: A row's output does not depend on how many rows share the call (no padding needed).
    row_independent: bool
    #: :meth:`logits` can skip the columns no row of a token mask allows.
    takes_token_mask: bool

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The layer applied to ``x``; the hot path, called without module dispatch."""
        ...

    def project_normed(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """:meth:`project` of ``norm(x)``."""
        ...

    def logits(self, x: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """Float32 output for an LM head: any row count, optionally only the columns ``allowed`` selects."""
        ...

    def load_targets(self) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]:
        """HF name -> (destination, first row in it, expected shape) of the tensors still loaded by name."""
        ...

    def packed_names(self) -> frozenset[str]:
        """HF names of the tensors this layer already holds in packed form."""
        ...


def _param(*shape: int, device: torch.device | None, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class TorchLinear(nn.Module):
    """A projection over torch weights, fused from ``parts`` stacked along the output rows."""

    row_independent = False
    takes_token_mask = False

    def __init__(
        self,
        parts: Sequence[WeightPart],
        in_features: int,
        *,
        bias: bool,
        device: torch.device | None,
        dtype: torch.dtype,
        weight: nn.Parameter | None = None,
    ) -> None:
        """``weight``: an existing parameter to share (tied embeddings); its tensor is loaded elsewhere."""
        super().__init__()
        self.parts = tuple(parts)
        self.in_features = in_features
        self.out_features = sum(p.rows for p in self.parts)
        self.shared = weight is not None
        self.weight = (
            weight
            if weight is not None
            else _param(self.out_features, in_features, device=device, dtype=dtype)
        )
        self.bias = _param(self.out_features, device=device, dtype=dtype) if bias else None

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``linear(x)`` in row chunks (see the module docstring)."""
        w, b = self.weight, self.bias
        return in_row_chunks(lambda h: F.linear(h, w, b), x)

    def project_normed(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """``linear(norm(x))`` in row chunks."""
        w, b, nw, eps = self.weight, self.bias, norm.weight, norm.eps
        return in_row_chunks(lambda h: F.linear(F.rms_norm(h, (h.shape[-1],), nw, eps), w, b), x)

    def logits(self, x: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """Float32 ``linear(x)`` for any row count (padded here); ``allowed`` is ignored (the caller masks)."""
        w, b = self.weight, self.bias
        return row_invariant(lambda h: F.linear(h.to(w.dtype), w, b), x).float()

    def load_targets(self) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]:
        """The weight rows of every part (unless shared) and the bias rows, by HF name."""
        targets: dict[str, tuple[torch.Tensor, int, tuple[int, ...]]] = {}
        row = 0
        for p in self.parts:
            if not self.shared:
                targets[p.name] = (self.weight, row, (p.rows, self.in_features))
            if self.bias is not None:
                targets[_bias_name(p.name)] = (self.bias, row, (p.rows,))
            row += p.rows
        return targets

    def packed_names(self) -> frozenset[str]:
        """None: every tensor is loaded by name."""
        return frozenset()


def _bias_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".bias"


class LinearBuilder(Protocol):
    """Makes the projections of a model; the loader's choice of builder is the choice of kernel."""

    def linear(self, parts: Sequence[WeightPart], in_features: int, *, bias: bool = False) -> Linear:
        """A projection fused from ``parts`` (stacked along the output rows)."""
        ...

    def head(self, name: str, rows: int, in_features: int, *, tied: nn.Parameter | None) -> Linear:
        """The LM head (HF name ``name``); ``tied`` is the embedding when the checkpoint ties them."""
        ...


class TorchLinears:
    """Builds :class:`TorchLinear` layers with empty weights, filled by name by ``load_weights``."""

    def __init__(self, device: torch.device | None, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype

    def linear(self, parts: Sequence[WeightPart], in_features: int, *, bias: bool = False) -> Linear:
        """An empty torch projection."""
        return TorchLinear(parts, in_features, bias=bias, device=self.device, dtype=self.dtype)

    def head(self, name: str, rows: int, in_features: int, *, tied: nn.Parameter | None) -> Linear:
        """The head over its own weights, or over the embedding's when tied."""
        return TorchLinear(
            [WeightPart(name, rows)],
            in_features,
            bias=False,
            device=self.device,
            dtype=self.dtype,
            weight=tied,
        )
