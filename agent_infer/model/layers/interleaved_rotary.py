"""DeepSeek V4's rotary embedding: interleaved pairs ``(x0, x1), (x2, x3)...`` on a head's trailing dims.

Only the last ``rope_dim`` values of each head rotate (the leading ones carry no position); cos/sin
are computed per call from the positions, in float32, as transformers computes them, so the
same positions give the same bits. Rotating by the negated angle undoes a rotation (V4 applies it
to the attention output, whose values carry the keys' rotation).
"""

from __future__ import annotations

import torch

from agent_infer.model.layers import native_deepseek


class InterleavedRotary:
    """Rotation of the trailing ``2 * len(inv_freq)`` dims of ``[..., D]`` rows by per-row positions.

    ``native``: float32 CPU rows rotate in one native call (engine_native/src/kernels/rope.cpp,
    the same products and sums as the torch formula, so the same bits) instead of ten torch ops.
    """

    def __init__(self, inv_freq: torch.Tensor, native: bool = False) -> None:
        self.inv_freq = inv_freq.float()
        self.rope_dim = 2 * int(inv_freq.shape[0])
        self.native = native

    def tables(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[rows, rope_dim]`` (each angle repeated for its pair) at ``pos`` ``[rows]``."""
        freqs = pos[:, None].float() * self.inv_freq.to(pos.device)[None, :]
        rows, half = int(freqs.shape[0]), int(freqs.shape[1])
        # expand + reshape copies each angle next to itself: repeat_interleave's values, fewer kernels
        cos = freqs.cos()[:, :, None].expand(rows, half, 2).reshape(rows, 2 * half)
        sin = freqs.sin()[:, :, None].expand(rows, half, 2).reshape(rows, 2 * half)
        return cos, sin

    def _native_ok(self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> bool:
        return (
            self.native
            and x.dtype is torch.float32
            and x.device.type == "cpu"
            and x.dim() in (2, 3)
            and all(t.dtype is torch.float32 and t.is_contiguous() for t in tables)
        )

    def norm_apply(
        self,
        x: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
        weight: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        """:meth:`apply` of ``x`` RMS-normalized over its last dim (times ``weight`` when given); a new tensor."""
        if self._native_ok(x, tables) and (weight is None or weight.dtype is torch.float32):
            return self._native(x, tables, False, 1 if weight is None else 2, weight, eps)
        if weight is None:
            normed = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
        else:
            normed = torch.nn.functional.rms_norm(x, (int(x.shape[-1]),), weight, eps)
        return self.apply(normed, tables)

    def _native(
        self,
        x: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
        inverse: bool,
        norm: int,
        weight: torch.Tensor | None,
        eps: float,
    ) -> torch.Tensor:
        y = x.clone(memory_format=torch.contiguous_format)
        rows, width = int(y.shape[0]), int(y.shape[-1])
        heads = int(y.shape[1]) if y.dim() == 3 else 1
        native_deepseek.rope_pairs(
            y, rows, heads, width, self.rope_dim, tables[0], tables[1], inverse, norm, weight, eps
        )
        return y

    def apply(
        self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], inverse: bool = False
    ) -> torch.Tensor:
        """``x`` ``[rows, D]`` or ``[rows, heads, D]`` with its trailing dims rotated (a new tensor)."""
        if self._native_ok(x, tables):
            return self._native(x, tables, inverse, 0, None, 0.0)
        cos, sin = tables
        if x.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        if inverse:
            sin = -sin
        rd = self.rope_dim
        nope, rope = x[..., :-rd], x[..., -rd:]
        pairs = rope.unflatten(-1, (-1, 2))
        rotated_half = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        rotated = (rope.float() * cos + rotated_half.float() * sin).to(x.dtype)
        return torch.cat((nope, rotated), dim=-1)
