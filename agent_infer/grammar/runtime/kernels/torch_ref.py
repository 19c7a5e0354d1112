"""The torch backend: the reference every other backend is tested against, and the fallback.

Plain tensor ops, so it runs on any device torch knows (CPU, CUDA, Ascend through ``torch_npu``)
and any floating dtype. It expands the words to a boolean allow-mask, which costs a
``[rows, 32 * words]`` temporary; the dedicated kernels avoid that.
"""

from __future__ import annotations

import torch

NAME = "torch"


def is_available(device: torch.device) -> bool:
    """Always: the reference needs nothing beyond torch."""
    return True


def supports(logits: torch.Tensor) -> bool:
    """Any floating dtype, any layout."""
    return bool(logits.is_floating_point())


def bool_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Expand ``[rows, words]`` int32 words to a ``[rows, vocab_size]`` bool allow-mask.

    Tokens past ``32 * words`` are disallowed: the mask is the only source of truth about which
    ids are legal. Bits past ``vocab_size`` are dropped.
    """
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros((bitmask.shape[0], vocab_size - width), dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None) -> None:
    """Set disallowed logits to ``-inf`` in place (rows ``indices`` of logits and bitmask, or all rows)."""
    if logits.is_inference() and not torch.is_inference_mode_enabled():
        # Logits made under inference_mode reject in-place ops outside it; masking needs no autograd.
        with torch.inference_mode():
            apply(logits, bitmask, indices)
        return
    if indices is None:
        logits.masked_fill_(~bool_mask(bitmask, logits.shape[1]), float("-inf"))
        return
    if indices.numel() == 0:
        return
    rows = logits[indices].masked_fill(~bool_mask(bitmask[indices], logits.shape[1]), float("-inf"))
    logits[indices] = rows
