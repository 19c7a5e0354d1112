"""DeepSeek's FP8 checkpoints: float8_e4m3fn weights with one float32 ``weight_scale_inv`` per block.

A weight ``[rows, cols]`` stored as FP8 comes with ``<name>_scale_inv`` of shape
``[ceil(rows / br), ceil(cols / bc)]`` (``quantization_config.weight_block_size`` = ``[br, bc]``,
128x128 in the released checkpoints); the real weight is ``fp8 * scale_inv`` block by block. We
dequantize at load, on the CPU, one tensor at a time, so peak memory is one float32 tensor more than
the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from agent_infer.errors import ModelLoadError

SCALE_SUFFIX = "_scale_inv"


def fp8_block_size(config: Mapping[str, Any], where: str = "") -> tuple[int, int] | None:
    """The ``[br, bc]`` block of an FP8 ``quantization_config`` (None for an unquantized checkpoint).

    Raises :class:`ModelLoadError` naming the key for any quantization this loader does not read.
    """
    quant = config.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, dict):
        raise ModelLoadError(f"{where}quantization_config must be an object")
    method = quant.get("quant_method")
    if method != "fp8":
        raise ModelLoadError(
            f"{where}unsupported quantization_config.quant_method {method!r}; supported: 'fp8'"
        )
    fmt = quant.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"{where}unsupported quantization_config.fmt {fmt!r}; supported: 'e4m3'")
    block = quant.get("weight_block_size", [128, 128])
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelLoadError(
            f"{where}quantization_config.weight_block_size must be two positive ints, got {block!r}"
        )
    return int(block[0]), int(block[1])


def dequantize_block_fp8(
    name: str, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """Float32 ``weight * scale_inv`` with each scale spread over its ``block``; errors name ``name``."""
    if weight.dim() != 2:
        raise ModelLoadError(f"FP8 tensor {name!r} has shape {tuple(weight.shape)}; block scales need 2 dims")
    rows, cols = weight.shape
    br, bc = block
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != want:
        raise ModelLoadError(
            f"tensor {name + SCALE_SUFFIX!r} has shape {tuple(scale_inv.shape)}, expected {want} "
            f"for {tuple(weight.shape)} in {br}x{bc} blocks"
        )
    scale = scale_inv.float().repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return weight.float() * scale


def fp8_weights(files: Sequence[Path], block: tuple[int, int]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` of every shard, FP8 weights dequantized with their scales (which may
    sit in another shard); a scale without its weight or an FP8 weight without its scale is an error."""
    with ExitStack() as stack:
        where: dict[str, Any] = {}
        for path in files:
            try:
                handle = stack.enter_context(safe_open(str(path), framework="pt"))
            except (SafetensorError, OSError, RuntimeError) as exc:
                raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file: {exc}") from exc
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                where[name] = handle
        for name, handle in where.items():
            if name.endswith(SCALE_SUFFIX):
                if name.removesuffix(SCALE_SUFFIX) not in where:
                    raise ModelLoadError(
                        f"scale tensor {name!r} has no weight {name.removesuffix(SCALE_SUFFIX)!r}"
                    )
                continue
            tensor = handle.get_tensor(name)
            scale_name = name + SCALE_SUFFIX
            if tensor.dtype == torch.float8_e4m3fn:
                if scale_name not in where:
                    raise ModelLoadError(f"FP8 tensor {name!r} has no {scale_name!r}")
                tensor = dequantize_block_fp8(name, tensor, where[scale_name].get_tensor(scale_name), block)
            elif scale_name in where:
                raise ModelLoadError(
                    f"{scale_name!r} scales {name!r}, which is {tensor.dtype}, not float8_e4m3fn"
                )
            yield name, tensor
