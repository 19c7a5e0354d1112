"""Reading the tensors of safetensors shards, quantized or not, under the names the family loads.

A quantized weight is paired with its scale by name, wherever the two sit among the shards:
``<name>_scale_inv`` (Hugging Face) or, for ``<module>.weight``, ``<module>.scale`` (DeepSeek's
released V4 layout). By the weight's dtype the pair is block FP8 (loading/fp8.py) or packed FP4
(loading/fp4.py, only where ``config.json`` declares ``expert_dtype: fp4``), and it is dequantized
to float32 here, unless its name is among those the model keeps in FP8 (then the FP8 weight and its
float32 scale, named ``<name>_scale_inv``, are yielded as they are). A scale without its weight, a
quantized weight without its scale, a wrong dtype or a wrong shape raise :class:`ModelLoadError`
naming the tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from agent_infer.errors import ModelLoadError
from agent_infer.model.loading.fp4 import PACKED_DTYPES, dequantize_fp4
from agent_infer.model.loading.fp8 import SCALE_SUFFIX, check_block_fp8, dequantize_block_fp8

#: Maps a checkpoint's tensor name to the family's (identity for checkpoints in the family's naming).
Rename = Callable[[str], str]

_EXPERT_DTYPES = ("fp8", "fp4", "bf16", "bfloat16")
_SCALE_FORMATS = ("float", "ue8m0")


@dataclass(frozen=True)
class QuantFormat:
    """How a checkpoint stores its quantized weights."""

    #: ``weight_block_size`` of the FP8 weights; None when ``config.json`` has no ``quantization_config``.
    block: tuple[int, int] | None
    #: Packed e2m1 weights (the routed experts of DeepSeek's V4 release) are expected.
    fp4: bool


def _block(quant: Mapping[str, Any], where: str) -> tuple[int, int]:
    block = quant.get("weight_block_size", [128, 128])
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ModelLoadError(
            f"{where}quantization_config.weight_block_size must be two positive ints, got {block!r}"
        )
    return int(block[0]), int(block[1])


def quant_format(config: Mapping[str, Any], where: str = "") -> QuantFormat | None:
    """The quantization a ``config.json`` declares (None: none). ``quantization_config`` must be
    DeepSeek's dynamic block FP8 (``scale_fmt`` float or ue8m0); ``expert_dtype`` (top level or inside
    it) one of fp8, fp4, bf16. Anything else raises :class:`ModelLoadError` naming the key."""
    quant = config.get("quantization_config")
    if quant is not None and not isinstance(quant, dict):
        raise ModelLoadError(f"{where}quantization_config must be an object")
    quant = quant or {}
    expert = config.get("expert_dtype", quant.get("expert_dtype"))
    if expert is not None and expert not in _EXPERT_DTYPES:
        raise ModelLoadError(
            f"{where}unsupported expert_dtype {expert!r}; supported: {', '.join(_EXPERT_DTYPES)}"
        )
    if not quant:
        return QuantFormat(block=None, fp4=True) if expert == "fp4" else None
    checks = (
        ("quant_method", None, ("fp8",)),
        ("fmt", "e4m3", ("e4m3",)),
        ("scale_fmt", "float", _SCALE_FORMATS),
        ("activation_scheme", "dynamic", ("dynamic",)),
    )
    for key, default, allowed in checks:
        value = quant.get(key, default)
        if value is None and default is not None:
            value = default
        if value not in allowed:
            raise ModelLoadError(
                f"{where}unsupported quantization_config.{key} {value!r}; supported: {', '.join(allowed)}"
            )
    return QuantFormat(block=_block(quant, where), fp4=expert == "fp4")


def _scale_of(name: str, names: Mapping[str, Any]) -> str | None:
    """The scale tensor stored for weight ``name``, if any."""
    if name + SCALE_SUFFIX in names:
        return name + SCALE_SUFFIX
    if name.endswith(".weight") and name.removesuffix("weight") + "scale" in names:
        return name.removesuffix("weight") + "scale"
    return None


def _weight_of(name: str, names: Mapping[str, Any]) -> str | None:
    """The weight ``name`` scales, when ``name`` is a scale tensor."""
    if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) in names:
        return name.removesuffix(SCALE_SUFFIX)
    if name.endswith(".scale") and name.removesuffix("scale") + "weight" in names:
        return name.removesuffix("scale") + "weight"
    return None


class _Shards:
    """Every shard open at once (memory-mapped), and which one holds each tensor."""

    def __init__(self, files: Sequence[Path], stack: ExitStack) -> None:
        self.where: dict[str, Any] = {}
        for path in files:
            try:
                handle = stack.enter_context(safe_open(str(path), framework="pt"))
            except (SafetensorError, OSError, RuntimeError) as exc:
                raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file: {exc}") from exc
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                self.where[name] = handle

    def get(self, name: str) -> torch.Tensor:
        try:
            return self.where[name].get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(f"tensor {name!r}: unreadable: {exc}") from exc

    def dtype(self, name: str) -> str:
        return str(self.where[name].get_slice(name).get_dtype())


def _dequantize(
    name: str, weight: torch.Tensor, scale_name: str, scale: torch.Tensor, fmt: QuantFormat | None
) -> torch.Tensor:
    if weight.dtype == torch.float8_e4m3fn:
        if fmt is None or fmt.block is None:
            raise ModelLoadError(f"FP8 tensor {name!r} but config.json has no quantization_config")
        return dequantize_block_fp8(name, weight, scale, fmt.block, scale_name)
    if weight.dtype in PACKED_DTYPES:
        if fmt is None or not fmt.fp4:
            raise ModelLoadError(
                f"tensor {name!r} is {weight.dtype} with scale {scale_name!r}, but config.json declares "
                "no FP4 weights (expert_dtype 'fp4')"
            )
        return dequantize_fp4(name, weight, scale, scale_name)
    raise ModelLoadError(
        f"{scale_name!r} scales {name!r}, which is {weight.dtype}, not float8_e4m3fn or packed FP4 (int8/uint8)"
    )


def checkpoint_weights(
    files: Sequence[Path],
    fmt: QuantFormat | None,
    rename: Rename | None = None,
    keep_fp8: frozenset[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` of every shard under the family's names (``rename`` applied),
    quantized weights dequantized to float32 except the FP8 ones named in ``keep_fp8`` (renamed
    names), which come as they are, each followed by its float32 scale ``<name>_scale_inv``."""
    with ExitStack() as stack:
        shards = _Shards(files, stack)
        names = shards.where
        for name in names:
            if _weight_of(name, names) is not None:
                continue
            if name.endswith(SCALE_SUFFIX):
                raise ModelLoadError(
                    f"scale tensor {name!r} has no weight {name.removesuffix(SCALE_SUFFIX)!r}"
                )
            # a '<module>.scale' without '<module>.weight' is an ordinary tensor; the family names it if unexpected
            tensor = shards.get(name)
            out = rename(name) if rename is not None else name
            scale_name = _scale_of(name, names)
            if scale_name is None:
                if tensor.dtype == torch.float8_e4m3fn:
                    raise ModelLoadError(
                        f"FP8 tensor {name!r} has no scale ({name + SCALE_SUFFIX!r} or a '.scale' sibling)"
                    )
                if fmt is not None and fmt.fp4 and tensor.dtype in PACKED_DTYPES and name.endswith(".weight"):
                    raise ModelLoadError(f"packed FP4 tensor {name!r} has no scale ('.scale' sibling)")
                yield out, tensor
                continue
            scale = shards.get(scale_name)
            if out in keep_fp8 and tensor.dtype == torch.float8_e4m3fn and fmt is not None and fmt.block:
                check_block_fp8(name, tensor, scale, fmt.block, scale_name)
                yield out, tensor
                yield out + SCALE_SUFFIX, scale.float()
                continue
            yield out, _dequantize(name, tensor, scale_name, scale, fmt)


def fp8_weight_names(files: Sequence[Path], rename: Rename | None = None) -> frozenset[str]:
    """The family's names of the FP8 weights stored with a scale (read from the headers only)."""
    with ExitStack() as stack:
        shards = _Shards(files, stack)
        names = shards.where
        return frozenset(
            rename(n) if rename is not None else n
            for n in names
            if shards.dtype(n) == "F8_E4M3" and _scale_of(n, names) is not None
        )
