"""FP4 (e2m1) weights with one scale per 32 inputs, as DeepSeek's released V4 checkpoints store routed experts.

A logical weight ``[rows, cols]`` is stored as bytes ``[rows, cols / 2]`` (``I8``, ``U8`` or torch's
``float4_e2m1fn_x2``): byte ``j`` of a row holds column ``2j`` in its low nibble and ``2j + 1`` in its
high nibble. A nibble is sign (bit 3), two exponent bits and one mantissa bit, so its values are
0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. The scale ``[rows, ceil(cols / 32)]`` multiplies each
run of 32 columns of a row; the release stores it as ``float8_e8m0fnu`` (a power of two), float32 and
bfloat16 scales read the same way. Dequantization is exact in float32: a nibble's value times a
power of two (or any float32 scale) rounds nowhere.
"""

from __future__ import annotations

import torch

from agent_infer.errors import ModelLoadError

#: Columns one scale covers.
GROUP = 32
#: The 16 nibble values, indexed by the nibble.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: Storage dtypes of packed FP4 bytes.
PACKED_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)
#: Dtypes a block or group scale may have.
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float8_e8m0fnu)


def check_scale(scale_name: str, scale: torch.Tensor) -> None:
    """Raise :class:`ModelLoadError` naming ``scale_name`` unless ``scale`` has a scale dtype and only
    finite values (a NaN or infinite scale would turn its whole block into NaN or infinity)."""
    if scale.dtype not in SCALE_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in SCALE_DTYPES)
        raise ModelLoadError(f"scale tensor {scale_name!r} is {scale.dtype}; expected one of {allowed}")
    if not bool(torch.isfinite(scale.float()).all()):
        raise ModelLoadError(f"scale tensor {scale_name!r} holds NaN or infinite values")


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Float32 ``[rows, 2 * packed_cols]`` values of packed e2m1 bytes ``[rows, packed_cols]``."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    u8 = packed.contiguous().view(torch.uint8)
    low = table[(u8 & 0xF).long()]
    high = table[(u8 >> 4).long()]
    return torch.stack((low, high), dim=-1).reshape(*u8.shape[:-1], 2 * int(u8.shape[-1]))


def dequantize_fp4(
    name: str, packed: torch.Tensor, scale: torch.Tensor, scale_name: str, group: int = GROUP
) -> torch.Tensor:
    """Float32 weight ``[rows, 2 * packed_cols]`` of ``packed`` times ``scale`` per ``group`` columns;
    a wrong dtype or shape raises :class:`ModelLoadError` naming ``name`` or ``scale_name``."""
    if packed.dtype not in PACKED_DTYPES:
        raise ModelLoadError(
            f"FP4 tensor {name!r} is {packed.dtype}; packed e2m1 weights are int8, uint8 or float4_e2m1fn_x2"
        )
    if packed.dim() != 2:
        raise ModelLoadError(f"FP4 tensor {name!r} has shape {tuple(packed.shape)}; expected 2 dims")
    check_scale(scale_name, scale)
    rows, cols = int(packed.shape[0]), 2 * int(packed.shape[1])
    want = (rows, -(-cols // group))
    if tuple(scale.shape) != want:
        raise ModelLoadError(
            f"scale tensor {scale_name!r} has shape {tuple(scale.shape)}, expected {want} for FP4 tensor "
            f"{name!r} of {rows}x{cols} values in groups of {group}"
        )
    spread = scale.float().repeat_interleave(group, dim=1)[:, :cols]
    return unpack_fp4(packed) * spread
