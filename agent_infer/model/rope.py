"""Rotary position embedding (HF's "rotate half" convention: pair i is ``(x[i], x[i + D/2])``).

``rotate_half`` is the torch formula. Packed CPU models rotate q/k in place on the fused qkv rows
with ``_native.rope_rows`` instead (engine_native/src/rope.cpp): the same roundings, so the same
bits, without ~14 us of torch calls per layer.
"""

from __future__ import annotations

import torch

from agent_infer.errors import EngineError


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[rows, heads, D]`` rotated by ``cos``/``sin`` ``[rows, 1, D/2]``; a new tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def native_rope_ok(cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor, dim: int) -> bool:
    """Whether :func:`rope_in_place` can take these tables and positions (CPU float32/int64, contiguous)."""
    try:
        from agent_infer import _native
    except ImportError:
        return False
    return (
        hasattr(_native, "rope_rows")
        and pos.dtype is torch.int64
        and pos.device.type == "cpu"
        and pos.is_contiguous()
        and cos.shape == sin.shape
        and all(
            t.dtype is torch.float32
            and t.device.type == "cpu"
            and t.is_contiguous()
            and t.shape[-1] * 2 == dim
            for t in (cos, sin)
        )
    )


def rope_in_place(
    qkv: torch.Tensor, qk_heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor
) -> None:
    """Rotate the first ``qk_heads`` heads of every row of ``qkv`` in place by the tables at ``pos``.

    ``cos``/``sin`` are ``[max_positions, dim/2]``; a position outside them raises ``IndexError``.
    """
    if qkv.dtype is not torch.float32 or qkv.device.type != "cpu" or not qkv.is_contiguous():
        raise EngineError("native RoPE needs a contiguous float32 CPU qkv tensor")
    rows = int(qkv.shape[0])
    if int(pos.shape[0]) < rows:
        raise EngineError(f"native RoPE: {int(pos.shape[0])} positions for {rows} rows")
    from agent_infer import _native

    _native.rope_rows(
        qkv.data_ptr(), rows, int(qkv.shape[1]), qk_heads, dim, cos.data_ptr(), sin.data_ptr(),
        int(cos.shape[0]), pos.data_ptr(),
    )  # fmt: skip
