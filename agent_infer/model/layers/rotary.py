"""Rotary position embedding (HF's "rotate half" convention: pair i is ``(x[i], x[i + D/2])``).

:class:`RotaryEmbedding` holds the cos/sin tables and rotates with torch ops;
:class:`NativeRotaryEmbedding` rotates q/k in place on the fused qkv rows with the native kernel
(engine_native/src/kernels/rope.cpp): the same roundings, so the same bits, without ~14 us of torch calls per
layer. The loader picks one per model; a forward asks it once for the :class:`Rotation` of its positions.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from agent_infer.errors import EngineError
from agent_infer.model.config import ModelConfig, rope_attention_factor, rope_inv_freq
from agent_infer.model.layers import native_ops


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[rows, heads, D]`` rotated by ``cos``/``sin`` ``[rows, 1, D/2]``; a new tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Rotation(Protocol):
    """The rotation of one forward's positions, applied to every layer's fused qkv rows."""

    def apply(self, qkv: torch.Tensor, qk_heads: int, dim: int) -> torch.Tensor:
        """The first ``qk_heads`` heads of ``qkv`` ``[rows, width]`` rotated, as ``[rows, qk_heads, dim]``."""
        ...


class _TorchRotation:
    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        self.cos = cos
        self.sin = sin

    def apply(self, qkv: torch.Tensor, qk_heads: int, dim: int) -> torch.Tensor:
        rows = int(qkv.shape[0])
        return rotate_half(qkv[:, : qk_heads * dim].view(rows, qk_heads, dim), self.cos, self.sin)


class RotaryEmbedding(nn.Module):
    """cos/sin tables ``[max_position_embeddings, head_dim/2]`` (``rope_scaling`` applied), torch rotation."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(self, config: ModelConfig, device: torch.device | None, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        factor = rope_attention_factor(config)
        if factor != 1.0:  # YaRN scales cos/sin (transformers does it in float32, before the cast)
            cos, sin = cos * factor, sin * factor
        self.register_buffer("cos", cos.to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("sin", sin.to(device=device, dtype=dtype), persistent=False)

    def at(self, pos: torch.Tensor) -> Rotation:
        """The rotation for positions ``pos`` (one per row)."""
        return _TorchRotation(self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1))


class _NativeRotation:
    def __init__(self, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor) -> None:
        self.cos = cos
        self.sin = sin
        self.pos = pos

    def apply(self, qkv: torch.Tensor, qk_heads: int, dim: int) -> torch.Tensor:
        rope_in_place(qkv, qk_heads, dim, self.cos, self.sin, self.pos)
        return qkv[:, : qk_heads * dim].view(int(qkv.shape[0]), qk_heads, dim)


def native_tables(rotation: Rotation) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(cos, sin, positions)`` of a native rotation (full float32 tables ``[max_positions, dim/2]``,
    int64 positions), for kernels that rotate as they go; None for a torch rotation."""
    if isinstance(rotation, _NativeRotation):
        return rotation.cos, rotation.sin, rotation.pos
    return None


class NativeRotaryEmbedding(RotaryEmbedding):
    """:class:`RotaryEmbedding` rotating in place with the native kernel (float32 CPU tables only)."""

    def __init__(self, config: ModelConfig, device: torch.device | None, dtype: torch.dtype) -> None:
        super().__init__(config, device, dtype)
        if not (dtype is torch.float32 and self.cos.device.type == "cpu" and config.head_dim % 2 == 0):
            raise EngineError("native RoPE needs even head_dim and float32 tables on the CPU")

    def at(self, pos: torch.Tensor) -> Rotation:
        """The rotation for positions ``pos`` (int64, contiguous, on the CPU after conversion)."""
        return _NativeRotation(self.cos, self.sin, pos.to(device="cpu", dtype=torch.int64).contiguous())


def rope_in_place(
    qkv: torch.Tensor, qk_heads: int, dim: int, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor
) -> None:
    """Rotate the first ``qk_heads`` heads of every row of ``qkv`` in place by the tables at ``pos``.

    ``cos``/``sin`` are contiguous float32 CPU ``[max_positions, dim/2]``; a position outside them
    raises ``IndexError``.
    """
    if qkv.dtype is not torch.float32 or qkv.device.type != "cpu" or not qkv.is_contiguous():
        raise EngineError("native RoPE needs a contiguous float32 CPU qkv tensor")
    rows = int(qkv.shape[0])
    if int(pos.shape[0]) < rows:
        raise EngineError(f"native RoPE: {int(pos.shape[0])} positions for {rows} rows")
    if pos.dtype is not torch.int64 or not pos.is_contiguous() or pos.device.type != "cpu":
        raise EngineError("native RoPE needs contiguous int64 CPU positions")
    native_ops.rope_rows(qkv, qk_heads, dim, cos, sin, pos)
