"""Token bitmasks: allocation and application to logits (C++ CPU kernel, torch fallback elsewhere).

Layout: int32 ``[batch, ceil(vocab / 32)]``; bit ``j`` of word ``w`` allows token ``32 * w + j``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agent_infer.native import load_native


def bitmask_words(vocab_size: int) -> int:
    """Number of int32 words per row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """An all-ones (allow everything) int32 bitmask of shape ``[batch_size, ceil(vocab_size / 32)]``."""
    return torch.full((batch_size, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def _bool_mask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Expand ``[rows, words]`` int32 words to a ``[rows, vocab_size]`` bool allow-mask."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    allowed = bits.reshape(bitmask.shape[0], -1).bool()
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    pad = torch.zeros((bitmask.shape[0], vocab_size - width), dtype=torch.bool, device=bitmask.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask_inplace_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: Sequence[int] | torch.Tensor | None = None
) -> None:
    """Reference/fallback backend for any dtype and device: masked logits become ``-inf``."""
    squeeze = logits.dim() == 1
    view = logits.unsqueeze(0) if squeeze else logits
    mask = bitmask.unsqueeze(0) if bitmask.dim() == 1 else bitmask
    mask = mask.to(view.device)
    if indices is None:
        if mask.shape[0] != view.shape[0]:
            raise ValueError(f"bitmask has {mask.shape[0]} rows but logits have {view.shape[0]}")
        allowed = _bool_mask(mask, view.shape[1])
        view.masked_fill_(~allowed, float("-inf"))
        return
    idx = torch.as_tensor(indices, dtype=torch.long, device=view.device)
    allowed = _bool_mask(mask[idx], view.shape[1])
    rows = view[idx]
    rows.masked_fill_(~allowed, float("-inf"))
    view[idx] = rows


def apply_token_bitmask_inplace(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: Sequence[int] | torch.Tensor | None = None
) -> None:
    """Set disallowed logits to ``-inf`` in place; ``indices`` selects rows (same row in logits and mask).

    float32 contiguous CPU tensors use the C++ kernel; everything else uses the torch fallback.
    """
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.is_contiguous()
        and bitmask.device.type == "cpu"
        and bitmask.dtype == torch.int32
    ):
        view = logits.unsqueeze(0) if logits.dim() == 1 else logits
        mask = bitmask.unsqueeze(0) if bitmask.dim() == 1 else bitmask
        idx = None if indices is None else torch.as_tensor(indices, dtype=torch.int64).contiguous()
        load_native().apply_token_bitmask_inplace_cpu(view, mask.contiguous(), idx)
        return
    apply_token_bitmask_inplace_torch(logits, bitmask, indices)
