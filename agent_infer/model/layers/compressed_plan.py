"""What every DeepSeek V4 layer of one forward shares: per sequence, its window and its compressed entries.

Built once per forward from the :class:`~agent_infer.model.layers.attention.AttentionPlan` (the
slots of each sequence's context), so the layers only do tensor math: the window's slots and band
mask are the same for every layer, and the entry slots and readiness mask the same for every layer
of one compression rate.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from agent_infer.model.layers.attention import AttentionPlan


@dataclass
class RateView:
    """One sequence's compressed entries at one rate: windows ``[first, count)`` close in this chunk."""

    first: int
    count: int
    #: Entry-pool slots of windows ``0 .. count - 1`` (the slot of each window's last token // stride).
    entry_slots: torch.Tensor
    #: Bool ``[L, count]``: entry ``w`` is complete by query ``t`` (``w < (t + 1) // rate``).
    ready: torch.Tensor


@dataclass
class SeqView:
    """One sequence's chunk: query rows ``[start, end)``, its context's slots and its window."""

    start: int
    end: int
    gather: torch.Tensor
    qpos: torch.Tensor
    window_slots: torch.Tensor
    #: Bool ``[L, len(window_slots)]``: key ``k`` is in query ``t``'s window ``(t - W, t]``.
    window_allowed: torch.Tensor
    rates: dict[int, RateView]


@dataclass
class CompressedPlan:
    """The per-forward plan of every sequence (and the flat slots of the new tokens)."""

    seqs: list[SeqView]
    slot_mapping: torch.Tensor
    num_tokens: int
    block_size: int


def plan_compressed(
    plan: AttentionPlan, window: int, rates: Iterable[int], block_size: int
) -> CompressedPlan:
    """The views of every sequence of ``plan`` for a sliding ``window`` and the compression ``rates``."""
    seqs = []
    for s in plan.seqs:
        ctx = int(s.gather.shape[0])
        first = ctx - (s.end - s.start)
        device = s.gather.device
        qpos = torch.arange(first, ctx, device=device)
        lo = max(0, first - window + 1)
        kpos = torch.arange(lo, ctx, device=device)
        allowed = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)
        views = {}
        for rate in rates:
            count = ctx // rate
            slots = s.gather[rate - 1 : count * rate : rate] // min(rate, block_size)
            ready = torch.arange(count, device=device)[None, :] < ((qpos + 1) // rate)[:, None]
            views[rate] = RateView(first // rate, count, slots, ready)
        seqs.append(SeqView(s.start, s.end, s.gather, qpos, s.gather[lo:ctx], allowed, views))
    return CompressedPlan(seqs, plan.slot_mapping, plan.num_tokens, block_size)
