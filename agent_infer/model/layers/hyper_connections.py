"""Manifold-constrained hyper-connections (DeepSeek V4): ``hc_mult`` residual streams per token.

A block reads one input collapsed from the streams (weights ``pre``), and writes back
``post * output + comb^T @ streams``, where ``comb`` (``hc_mult x hc_mult``) is pushed towards a
doubly-stochastic matrix by Sinkhorn-Knopp iterations so that mixing streams cannot blow up their
norm. ``pre``, ``post`` and ``comb`` come from one projection of the RMS-normed, flattened streams.
The model's end collapses the streams once more (:class:`HyperHead`) before the final norm.

Whatever could round differently with the batch (the projections' GEMMs, the sigmoids' vectorized
exp) runs in chunks of exactly ROW_MULTIPLE rows (see layers/linear.py); the rest is element-wise
or reduces within a row in a fixed order, and runs over the whole batch. A token's mixing weights
are the same bits whatever its batch.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from agent_infer.model.layers import native_deepseek
from agent_infer.model.layers.linear import ROW_MULTIPLE, in_row_chunks


def _param(*shape: int, device: torch.device | None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=torch.float32), requires_grad=False)


def _unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class HyperConnection(nn.Module):
    """The mixing weights of one block site (HF names ``hc_{attn,ffn}_{fn,base,scale}``), float32.

    ``native``: collapse float32 CPU rows with the native kernel (engine_native/src/kernels/hyper.cpp),
    batch invariant row by row without the 4-row chunks; the torch path otherwise.
    """

    def __init__(
        self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float,
        device: torch.device | None, native: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.native = native
        self.hc = hc_mult
        self.iters = sinkhorn_iters
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        width = (2 + hc_mult) * hc_mult
        self.fn = _param(width, hc_mult * hidden_size, device=device)
        self.base = _param(width, device=device)
        self.scale = _param(3, device=device)

    def collapse(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(post [R, hc], comb [R, hc, hc], collapsed [R, H])`` of ``streams`` ``[R, hc, H]``."""
        if self.native:
            return native_deepseek.hc_collapse(
                streams, self.fn, self.base, self.scale, self.iters, self.hc_eps, self.norm_eps
            )
        hc, rows = self.hc, int(streams.shape[0])
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])

        # The projection (one GEMM shape per row) and the sigmoids (vectorized and scalar exp round
        # differently, and a row's place in the vectors depends on the batch) run in fixed row
        # chunks; the rest reduces within a row or is exactly rounded, over the whole batch.
        def gates(x: torch.Tensor) -> torch.Tensor:
            mixes = F.linear(x, self.fn)
            pre = torch.sigmoid(mixes[:, :hc] * self.scale[0] + pre_b) + self.hc_eps
            post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * self.scale[1] + post_b)
            return torch.cat((pre, post, mixes[:, 2 * hc :]), dim=-1)

        out = in_row_chunks(gates, _unit_rms(streams.reshape(rows, -1).float(), self.norm_eps))
        comb = torch.softmax(
            out[:, 2 * hc :].view(rows, hc, hc) * self.scale[2] + comb_b.view(hc, hc), dim=-1
        )
        collapsed = _weighted_streams(out[:, :hc], streams)
        return out[:, hc : 2 * hc], sinkhorn(comb + self.hc_eps, self.iters, self.hc_eps), collapsed


def _weighted_streams(weights: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``sum_i weights[:, i] * streams[:, i]`` (float32 products, added in stream order, rounded to
    the streams' dtype), element-wise so that every row rounds alike whatever the batch."""
    parts = (weights.unsqueeze(-1) * streams).unbind(1)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total.to(streams.dtype)


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """``iters`` Sinkhorn-Knopp normalizations of ``comb`` ``[R, n, n]``: columns, then rows and
    columns ``iters - 1`` times, each sum plus ``eps`` (transformers' order).

    The whole batch runs at once: each sum reduces ``n`` values within one row's matrix, which
    ATen's CPU reduction adds in index order for every row whatever the row count (the same bits
    as writing the additions out; the batch-invariance tests of the DeepSeek V4 family cover it),
    and the divisions are exactly rounded element by element.
    """
    if comb.device.type == "cpu" and comb.dtype == torch.float32:
        return torch.from_numpy(_sinkhorn_numpy(comb.contiguous().numpy(), iters, np.float32(eps)))
    return sinkhorn_torch(comb, iters, eps)


def sinkhorn_torch(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """:func:`sinkhorn` in torch ops (any device and dtype)."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def _sinkhorn_numpy(comb: np.ndarray, iters: int, eps: np.float32) -> np.ndarray:
    # The same float32 operations in the same order as the torch loop (same bits), at a third of
    # its per-call overhead, which is what 2 * iters tiny reductions cost on the CPU.
    comb = comb / (comb.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        comb /= comb.sum(axis=-1, keepdims=True) + eps
        comb /= comb.sum(axis=-2, keepdims=True) + eps
    return comb


def _chunked(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    n = int(xs[0].shape[0])
    if xs[0].device.type != "cpu" or n <= ROW_MULTIPLE:
        return fn(*xs)
    return torch.cat([fn(*(x[i : i + ROW_MULTIPLE] for x in xs)) for i in range(0, n, ROW_MULTIPLE)])


def expand(
    post: torch.Tensor, comb: torch.Tensor, output: torch.Tensor, streams: torch.Tensor, native: bool = False
) -> torch.Tensor:
    """New streams ``post * output + comb^T @ streams`` (``[R, hc, H]``), in fixed row chunks, or
    row by row natively (float32 CPU) with ``native``."""
    if native:
        return native_deepseek.hc_expand(post, comb, output, streams)

    def mix(p: torch.Tensor, c: torch.Tensor, o: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return p.unsqueeze(-1) * o.unsqueeze(-2) + torch.matmul(c.transpose(-1, -2), s)

    return _chunked(mix, post.to(streams.dtype), comb.to(streams.dtype), output, streams)


class HyperHead(nn.Module):
    """The final collapse of the streams (HF names ``model.hc_head.hc_{fn,base,scale}``), float32;
    ``native`` as for :class:`HyperConnection`."""

    def __init__(
        self,
        hidden_size: int,
        hc_mult: int,
        hc_eps: float,
        norm_eps: float,
        device: torch.device | None,
        native: bool = False,
    ):
        super().__init__()
        self.native = native
        self.hc_eps = hc_eps
        self.norm_eps = norm_eps
        self.fn = _param(hc_mult, hc_mult * hidden_size, device=device)
        self.base = _param(hc_mult, device=device)
        self.scale = _param(1, device=device)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """``[R, H]`` from ``streams`` ``[R, hc, H]``."""
        if self.native:
            return native_deepseek.hc_head(
                streams, self.fn, self.base, self.scale, self.hc_eps, self.norm_eps
            )

        def head(s: torch.Tensor) -> torch.Tensor:
            mixes = F.linear(_unit_rms(s.reshape(int(s.shape[0]), -1).float(), self.norm_eps), self.fn)
            pre = torch.sigmoid(mixes * self.scale + self.base) + self.hc_eps
            return (pre.unsqueeze(-1) * s).sum(dim=1).to(s.dtype)

        return in_row_chunks(head, streams)
