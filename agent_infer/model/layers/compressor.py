"""DeepSeek V4's KV compressor: one entry per window of ``rate`` tokens, gated by a softmax over the window.

Each token contributes a value ``C`` and a gate ``Z`` (projections of the layer's input, kept per
token in the state pool of the compressed cache layout); the entry of window ``w`` is
``norm(sum_j softmax_j(Z_j + B_j) * C_j)`` per channel, ``B`` a learned bias per offset in the window
(``ape``), rotated at position ``w * rate``.

Heavily compressed attention pools the ``rate`` tokens of its window. Compressed sparse attention
(and its indexer) projects two series per token, ``Ca`` (first half) and ``Cb`` (second half):
entry ``w`` pools window ``w - 1``'s ``Ca`` together with window ``w``'s ``Cb`` over ``2 * rate``
slots, so consecutive entries overlap by one window; window 0 has no predecessor (those slots get
zero weight). Entries are computed when the token that completes their window is computed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agent_infer.model.layers.interleaved_rotary import InterleavedRotary


class WindowCompressor(nn.Module):
    """The pooling of one compressor (``ape`` ``[rate, series * dim]`` and the ``norm`` weight), float32 bias."""

    def __init__(
        self, rate: int, dim: int, overlap: bool, eps: float, device: torch.device | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.rate = rate
        self.dim = dim
        self.overlap = overlap
        self.series = 2 if overlap else 1
        self.eps = eps
        self.ape = nn.Parameter(
            torch.empty(rate, self.series * dim, device=device, dtype=torch.float32), requires_grad=False
        )
        self.norm = nn.Parameter(torch.empty(dim, device=device, dtype=dtype), requires_grad=False)

    @property
    def state_width(self) -> int:
        """Values stored per token: the value and gate projections of every series."""
        return 2 * self.series * self.dim

    def pool(self, states: torch.Tensor, first: int, count: int, rotary: InterleavedRotary) -> torch.Tensor:
        """Entries of windows ``first .. first + count - 1`` (``[count, dim]``), rotated.

        ``states`` ``[tokens, state_width]`` holds the tokens of those windows in order, preceded by the
        ``rate`` tokens of window ``first - 1`` when this compressor overlaps and ``first > 0``.
        """
        r, d, width = self.rate, self.dim, self.series * self.dim
        kv = states[:, :width].reshape(-1, r, width)
        gate = states[:, width:].reshape(-1, r, width).float() + self.ape
        if not self.overlap:
            slots_kv, slots_gate = kv, gate
        else:
            lead = int(kv.shape[0]) - count  # 1 when window first - 1 is included
            prev_kv = kv[:-1, :, :d] if lead else kv.new_zeros(count, r, d)
            prev_gate = gate[:-1, :, :d] if lead else gate.new_full((count, r, d), float("-inf"))
            if not lead and count > 1:
                prev_kv = torch.cat((prev_kv[:1], kv[:-1, :, :d]))
                prev_gate = torch.cat((prev_gate[:1], gate[:-1, :, :d]))
            slots_kv = torch.cat((prev_kv, kv[lead:, :, d:]), dim=1)
            slots_gate = torch.cat((prev_gate, gate[lead:, :, d:]), dim=1)
        weights = slots_gate.softmax(dim=1).to(slots_kv.dtype)
        pooled = F.rms_norm((slots_kv * weights).sum(dim=1), (d,), self.norm, self.eps)
        pos = torch.arange(first, first + count, device=states.device) * r
        return rotary.apply(pooled, rotary.tables(pos))

    def pool_each(
        self, states: torch.Tensor, windows: torch.Tensor, lead: int, rotary: InterleavedRotary
    ) -> torch.Tensor:
        """The entry of one window per row (``[b, dim]``, rotated), for rows of different sequences.

        ``states`` ``[b, (1 + lead) * rate, state_width]``: each row's window, preceded by its
        window ``w - 1`` when ``lead`` is 1 (overlapping compressors past window 0); ``windows``
        ``[b]`` the windows' indices. The same arithmetic as :meth:`pool` of one window.
        """
        r, d, width = self.rate, self.dim, self.series * self.dim
        b = int(states.shape[0])
        kv = states[..., :width].reshape(b, 1 + lead, r, width)
        gate = states[..., width:].reshape(b, 1 + lead, r, width).float() + self.ape
        if not self.overlap:
            slots_kv, slots_gate = kv[:, 0], gate[:, 0]
        else:
            prev_kv = kv[:, 0, :, :d] if lead else kv.new_zeros(b, r, d)
            prev_gate = gate[:, 0, :, :d] if lead else gate.new_full((b, r, d), float("-inf"))
            slots_kv = torch.cat((prev_kv, kv[:, lead, :, d:]), dim=1)
            slots_gate = torch.cat((prev_gate, gate[:, lead, :, d:]), dim=1)
        weights = slots_gate.softmax(dim=1).to(slots_kv.dtype)
        pooled = F.rms_norm((slots_kv * weights).sum(dim=1), (d,), self.norm, self.eps)
        return rotary.apply(pooled, rotary.tables(windows * r))
