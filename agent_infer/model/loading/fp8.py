"""DeepSeek's FP8 checkpoints: float8_e4m3fn weights with one scale per block.

A weight ``[rows, cols]`` stored as FP8 comes with a scale of shape ``[ceil(rows / br),
ceil(cols / bc)]`` (``quantization_config.weight_block_size`` = ``[br, bc]``, 128x128 in the
released checkpoints); the real weight is ``fp8 * scale`` block by block. Hugging Face checkpoints
name the scale ``<weight>_scale_inv`` and store it as float32; DeepSeek's released V4 checkpoints
name it ``<module>.scale`` and store powers of two (``float8_e8m0fnu``, ``scale_fmt: ue8m0``). Both
multiply. Dequantization (here, at load) is exact in float32.
"""

from __future__ import annotations

import torch

from agent_infer.errors import ModelLoadError
from agent_infer.model.loading.fp4 import check_scale

SCALE_SUFFIX = "_scale_inv"
#: The largest finite float8_e4m3fn magnitude.
FP8_MAX = 448.0


def block_scale_shape(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a ``rows x cols`` weight in ``block`` blocks (edge blocks may be partial)."""
    return -(-rows // block[0]), -(-cols // block[1])


def spread_block_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """Float32 ``[rows, cols]``: each block's scale repeated over the block."""
    br, bc = block
    return scale.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]


def check_block_fp8(
    name: str,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    scale_name: str | None = None,
) -> None:
    """Raise :class:`ModelLoadError` naming the tensor unless ``weight`` is a 2-D FP8 tensor and
    ``scale`` its block grid in a scale dtype."""
    scale_name = scale_name or name + SCALE_SUFFIX
    if weight.dtype != torch.float8_e4m3fn:
        raise ModelLoadError(f"FP8 tensor {name!r} is {weight.dtype}, not float8_e4m3fn")
    if weight.dim() != 2:
        raise ModelLoadError(f"FP8 tensor {name!r} has shape {tuple(weight.shape)}; block scales need 2 dims")
    check_scale(scale_name, scale)
    rows, cols = int(weight.shape[0]), int(weight.shape[1])
    want = block_scale_shape(rows, cols, block)
    if tuple(scale.shape) != want:
        raise ModelLoadError(
            f"tensor {scale_name!r} has shape {tuple(scale.shape)}, expected {want} "
            f"for {tuple(weight.shape)} in {block[0]}x{block[1]} blocks"
        )


def dequantize_block_fp8(
    name: str,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    scale_name: str | None = None,
) -> torch.Tensor:
    """Float32 ``weight * scale`` with each scale spread over its ``block``; errors name ``name``
    (and ``scale_name``, by default ``name + '_scale_inv'``)."""
    check_block_fp8(name, weight, scale_inv, block, scale_name)
    rows, cols = int(weight.shape[0]), int(weight.shape[1])
    return weight.float() * spread_block_scale(scale_inv, rows, cols, block)
