"""DeepSeek V4's rotary embedding: interleaved pairs ``(x0, x1), (x2, x3)...`` on a head's trailing dims.

Only the last ``rope_dim`` values of each head rotate (the leading ones carry no position); cos/sin
are computed per call from the positions, in float32, as transformers computes them, so the
same positions give the same bits. Rotating by the negated angle undoes a rotation (V4 applies it
to the attention output, whose values carry the keys' rotation).
"""

from __future__ import annotations

import torch


class InterleavedRotary:
    """Rotation of the trailing ``2 * len(inv_freq)`` dims of ``[..., D]`` rows by per-row positions."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq.float()
        self.rope_dim = 2 * int(inv_freq.shape[0])

    def tables(self, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[rows, rope_dim]`` (each angle repeated for its pair) at ``pos`` ``[rows]``."""
        freqs = pos[:, None].float() * self.inv_freq.to(pos.device)[None, :]
        return freqs.cos().repeat_interleave(2, dim=-1), freqs.sin().repeat_interleave(2, dim=-1)

    def apply(
        self, x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor], inverse: bool = False
    ) -> torch.Tensor:
        """``x`` ``[rows, D]`` or ``[rows, heads, D]`` with its trailing dims rotated (a new tensor)."""
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
