"""Projections over block-FP8 weights kept in FP8, for accelerators that run FP8 matmuls.

The kernel contract is DeepSeek's, as vLLM and SGLang run it for DeepSeek's FP8 checkpoints. The
weight ``W [N, K]`` is e4m3 with one float32 scale per ``br x bk`` block (``W = q_w * s_w``). Each
row of the activation ``x [M, K]`` is quantized per group of ``bk`` columns to e4m3 with the
dynamic scale ``s_x = amax(|group|) / 448``. Then::

    y[m, n] = sum_g s_x[m, g] * s_w[n // br, g] * sum_{k in g} q_x[m, k] * q_w[n, k]

with float32 products and sums, and ``y`` in ``x``'s dtype. Two implementations run it:

* ``blockwise``: one ``torch.nn.functional.scaled_mm`` with 1x128 activation and 128x128 weight
  scales (cuBLASLt on Hopper); ``br = bk = 128`` and ``N``, ``K`` multiples of 128.
* ``per_group``: one row-wise scaled ``scaled_mm`` per group of ``bk`` columns (``s_x[:, g]`` per row,
  ``s_w[n // br, g]`` per column), summed in float32; any block and shape, on any GPU with FP8
  (sm_89+) and on torch's CPU kernel.

:func:`emulate_block_fp8_matmul` computes the same contract in float64 from the dequantized
operands: the loader checks an implementation against it on the device before using it
(loading/fp8_select.py), and the tests check both against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from agent_infer.errors import EngineError
from agent_infer.model.layers.linear import Linear, TorchLinears, WeightPart, in_row_chunks, row_invariant
from agent_infer.model.layers.norm import RMSNorm
from agent_infer.model.loading.fp8 import FP8_MAX, SCALE_SUFFIX, block_scale_shape

#: The FP8 matmul implementations, fastest first.
MATMULS = ("blockwise", "per_group")
# a group of zeros gets this scale instead of 0 (its values quantize to 0 either way)
_MIN_AMAX = 1e-12


def quantize_activation(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` as e4m3 values and float32 scales ``[M, ceil(K / group)]`` (amax / 448 per group)."""
    m, k = int(x.shape[0]), int(x.shape[1])
    groups = -(-k // group)
    xf = x.float()
    if groups * group != k:
        xf = F.pad(xf, (0, groups * group - k))
    g = xf.view(m, groups, group)
    scale = g.abs().amax(dim=-1).clamp(min=_MIN_AMAX) / FP8_MAX
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, groups * group)[:, :k], scale


def emulate_block_fp8_matmul(
    qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """The contract in float64: ``sum_g s_x[:, g] * s_w[n // br, g] * (q_x[:, g] @ q_w[:, g]^T)``."""
    br, bk = block
    n, k = int(qw.shape[0]), int(qw.shape[1])
    out = torch.zeros(int(qx.shape[0]), n, dtype=torch.float64, device=qx.device)
    col_scale = sw.double().repeat_interleave(br, 0)[:n]  # [N, groups]
    for g, start in enumerate(range(0, k, bk)):
        part = qx[:, start : start + bk].double() @ qw[:, start : start + bk].double().t()
        out += sx[:, g : g + 1].double() * col_scale[:, g][None] * part
    return out


def per_group_matmul(
    qx: torch.Tensor,
    sx: torch.Tensor,
    qw: torch.Tensor,
    sw: torch.Tensor,
    block: tuple[int, int],
    row_block: torch.Tensor,
) -> torch.Tensor:
    """Float32 ``[M, N]`` by one row-wise scaled FP8 matmul per group (``row_block[n] = n // br``)."""
    bk = block[1]
    k = int(qw.shape[1])
    col_scale = sw.float().index_select(0, row_block).t().contiguous()  # [groups, N]
    out: torch.Tensor | None = None
    for g, start in enumerate(range(0, k, bk)):
        part = F.scaled_mm(
            qx[:, start : start + bk].contiguous(),
            qw[:, start : start + bk].t(),
            sx[:, g : g + 1].contiguous(),
            F.ScalingType.RowWise,
            col_scale[g : g + 1],
            F.ScalingType.RowWise,
            output_dtype=torch.float32,
        )
        out = part if out is None else out + part
    assert out is not None
    return out


def blockwise_matmul(qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """Float32 ``[M, N]`` by one 1x128 / 128x128 block-scaled FP8 matmul."""
    return F.scaled_mm(
        qx,
        qw.t(),
        # cuBLASLt reads the activation scales with M as the fast dimension
        sx.t().contiguous().t(),
        F.ScalingType.BlockWise1x128,
        sw.float(),
        F.ScalingType.BlockWise128x128,
        output_dtype=torch.float32,
    )


def blockwise_fits(n: int, k: int, block: tuple[int, int]) -> bool:
    """Whether a weight of ``n x k`` in ``block`` blocks can take the ``blockwise`` matmul."""
    return block == (128, 128) and n % 128 == 0 and k % 128 == 0


def fp8_fits(n: int, k: int, block: tuple[int, int], device: torch.device | None) -> bool:
    """Whether an ``n x k`` weight can run an FP8 matmul on ``device``: CUDA's FP8 GEMMs take
    operands whose dimensions are multiples of 16 (every group of ``bk`` columns included)."""
    if device is None or torch.device(device).type == "cpu":
        return True
    return n % 16 == 0 and k % 16 == 0 and block[1] % 16 == 0


class Fp8Linear(nn.Module):
    """``y = x @ W^T`` with ``W`` kept in e4m3 plus its block scales, fused from ``parts`` along N."""

    row_independent = False
    takes_token_mask = False

    def __init__(
        self,
        parts: Sequence[WeightPart],
        in_features: int,
        block: tuple[int, int],
        matmul: str,
        device: torch.device | None,
    ) -> None:
        """Every part but the last must fill whole blocks of rows (its scales start a block row)."""
        super().__init__()
        if matmul not in MATMULS:
            raise EngineError(f"unknown FP8 matmul {matmul!r}; expected one of {', '.join(MATMULS)}")
        self.parts = tuple(parts)
        self.in_features = in_features
        self.out_features = sum(p.rows for p in self.parts)
        self.block = block
        if any(p.rows % block[0] for p in self.parts[:-1]):
            raise EngineError(
                f"fused FP8 parts {[p.name for p in self.parts]} do not start on {block[0]}-row blocks"
            )
        n, k = self.out_features, in_features
        self.matmul = "per_group" if matmul == "blockwise" and not blockwise_fits(n, k, block) else matmul
        self.weight = nn.Parameter(
            torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device), requires_grad=False
        )
        self.scale = nn.Parameter(
            torch.empty(block_scale_shape(n, k, block), dtype=torch.float32, device=device),
            requires_grad=False,
        )
        self.row_block: torch.Tensor
        self.register_buffer("row_block", torch.arange(n, device=device) // block[0], persistent=False)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        qx, sx = quantize_activation(x, self.block[1])
        if self.matmul == "blockwise":
            y = blockwise_matmul(qx, sx, self.weight, self.scale)
        else:
            y = per_group_matmul(qx, sx, self.weight, self.scale, self.block, self.row_block)
        return y.to(x.dtype)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """The FP8 matmul of ``x``, in row chunks on the CPU (see layers/linear.py)."""
        return in_row_chunks(self._matmul, x)

    def project_normed(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """:meth:`project` of ``norm(x)``."""
        return self.project(norm.forward(x))

    def logits(self, x: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
        """Float32 output for any row count; ``allowed`` is ignored (the caller masks)."""
        return row_invariant(self._matmul, x).float()

    def dequantized(self) -> torch.Tensor:
        """The float32 weight ``q_w * s_w``."""
        n, k = self.out_features, self.in_features
        spread = self.scale.repeat_interleave(self.block[0], 0)[:n].repeat_interleave(self.block[1], 1)[:, :k]
        return self.weight.float() * spread

    def load_targets(self) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]:
        """Each part's FP8 rows and its block-scale rows (``<name>_scale_inv``), by HF name."""
        targets: dict[str, tuple[torch.Tensor, int, tuple[int, ...]]] = {}
        row = 0
        for p in self.parts:
            targets[p.name] = (self.weight, row, (p.rows, self.in_features))
            targets[p.name + SCALE_SUFFIX] = (
                self.scale,
                row // self.block[0],
                block_scale_shape(p.rows, self.in_features, self.block),
            )
            row += p.rows
        return targets

    def packed_names(self) -> frozenset[str]:
        """None: the FP8 weights are loaded by name."""
        return frozenset()


class Fp8Linears:
    """Builds :class:`Fp8Linear` layers for the projections whose every part the checkpoint stores in
    FP8 (with no bias, parts on block rows, shapes the device's FP8 GEMM takes), torch layers for
    the rest; records the names it keeps in FP8."""

    def __init__(
        self,
        torch_linears: TorchLinears,
        fp8_names: frozenset[str],
        block: tuple[int, int],
        matmul: str,
    ) -> None:
        self.torch = torch_linears
        self.fp8_names = fp8_names
        self.block = block
        self.matmul = matmul
        #: HF names of the weights the built layers hold in FP8 (the loader reads them as they are).
        self.kept: set[str] = set()

    def linear(self, parts: Sequence[WeightPart], in_features: int, *, bias: bool = False) -> Linear:
        """An FP8 projection when every part is stored in FP8 and the parts align with the blocks."""
        aligned = all(p.rows % self.block[0] == 0 for p in parts[:-1])
        fits = fp8_fits(sum(p.rows for p in parts), in_features, self.block, self.torch.device)
        if bias or not aligned or not fits or not all(p.name in self.fp8_names for p in parts):
            return self.torch.linear(parts, in_features, bias=bias)
        self.kept.update(p.name for p in parts)
        return Fp8Linear(parts, in_features, self.block, self.matmul, self.torch.device)

    def head(self, name: str, rows: int, in_features: int, *, tied: nn.Parameter | None) -> Linear:
        """The LM head on the torch path (DeepSeek's heads are not FP8; an FP8 one is dequantized)."""
        return self.torch.head(name, rows, in_features, tied=tied)
