"""Whether a block-FP8 checkpoint's projections stay in FP8 at load, and which FP8 matmul runs them.

``AGENT_INFER_FP8_WEIGHTS`` (envs.py) sets the policy:

========== ===================================================================================
auto       FP8 on a device whose hardware runs FP8 matmuls (:meth:`Accelerator.fp8_matmuls`:
           NVIDIA sm_89+); dequantized at load on the CPU, on Ascend and on older GPUs
dequantize always dequantized at load (float weights, as on the CPU)
keep       FP8 wherever an FP8 matmul runs, the CPU's torch kernel included (slow: for checking
           the path); a device with none raises :class:`ConfigError`
========== ===================================================================================

Before a matmul is used, it runs once on the device on a small random problem and must match
:func:`~agent_infer.model.layers.fp8_linear.emulate_block_fp8_matmul`; the first that does is taken
(``blockwise``, then ``per_group``). When none does, ``auto`` dequantizes at load and ``keep`` raises
:class:`EngineError` with each matmul's failure. The projections kept in FP8 are those the family
builds as linears (layers/fp8_linear.py) whose every checkpoint part is FP8; other FP8 tensors (MoE
experts, MLA's ``kv_b``, V4's ``wo_a``) are dequantized at load.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from agent_infer import envs
from agent_infer.accelerator import Accelerator
from agent_infer.errors import ConfigError, EngineError
from agent_infer.model.layers.fp8_linear import (
    Fp8Linears,
    blockwise_fits,
    blockwise_matmul,
    emulate_block_fp8_matmul,
    per_group_matmul,
    quantize_activation,
)
from agent_infer.model.layers.kernels import Kernels, torch_kernels
from agent_infer.model.layers.linear import TorchLinears
from agent_infer.model.loading.hf import hf_fp8_weight_names, hf_quant_format

logger = logging.getLogger(__name__)

_ACCELERATOR_OF_DEVICE = {"cpu": "cpu", "cuda": "nvidia", "npu": "ascend"}
# relative to the output's largest magnitude: the implementations differ from the float64
# emulation only by float32 summation order
_PROBE_TOLERANCE = 1e-4


@dataclass(frozen=True)
class Fp8Plan:
    """The outcome: the FP8 matmul the projections run (None: dequantized at load) and why."""

    matmul: str | None
    reason: str


def accelerator_of(device: torch.device) -> Accelerator:
    """The :class:`Accelerator` a torch device belongs to (named by its device type when the switch
    has no backend for it, e.g. ``mps``: such a device runs no FP8 matmul here)."""
    return Accelerator(_ACCELERATOR_OF_DEVICE.get(device.type, device.type), device)


def probe_matmul(matmul: str, device: torch.device, block: tuple[int, int]) -> str | None:
    """Run ``matmul`` once on ``device`` against the float64 emulation: None when it matches, else why not."""
    gen = torch.Generator().manual_seed(0)
    n, k = 2 * block[0], 2 * block[1]
    if matmul == "blockwise" and not blockwise_fits(n, k, block):
        return f"blockwise needs 128x128 blocks, the checkpoint has {block[0]}x{block[1]}"
    try:
        x = torch.randn(8, k, generator=gen).to(device)
        qw = torch.randn(n, k, generator=gen).clamp(-400, 400).to(torch.float8_e4m3fn).to(device)
        sw = torch.rand(n // block[0], k // block[1], generator=gen).add(0.5).to(device)
        qx, sx = quantize_activation(x, block[1])
        if matmul == "blockwise":
            got = blockwise_matmul(qx, sx, qw, sw)
        else:
            got = per_group_matmul(qx, sx, qw, sw, block, torch.arange(n, device=device) // block[0])
        want = emulate_block_fp8_matmul(qx, sx, qw, sw, block)
    except (RuntimeError, TypeError, ValueError, AttributeError) as exc:
        return f"{matmul} failed on {device}: {type(exc).__name__}: {exc}"
    err = float((got.double() - want).abs().max()) / max(float(want.abs().max()), 1e-30)
    if not err <= _PROBE_TOLERANCE:
        return f"{matmul} on {device} differs from the emulated contract by {err:.2e} (relative)"
    return None


def plan_fp8(
    mode: str,
    accelerator: Accelerator,
    block: tuple[int, int],
    probe: Callable[[str, torch.device, tuple[int, int]], str | None] = probe_matmul,
) -> Fp8Plan:
    """Decide, for a checkpoint with FP8 weights in ``block`` blocks, how ``accelerator`` holds them."""
    if mode == "dequantize":
        return Fp8Plan(None, "AGENT_INFER_FP8_WEIGHTS=dequantize")
    candidates = accelerator.fp8_matmuls()
    if not candidates:
        if mode == "auto":
            return Fp8Plan(None, f"the {accelerator.name} device has no FP8 matmul unit; dequantized at load")
        if accelerator.is_cpu:
            candidates = ("per_group",)
        else:
            raise ConfigError(
                f"AGENT_INFER_FP8_WEIGHTS=keep, but the {accelerator.name} device {accelerator.device} "
                "runs no FP8 matmul (NVIDIA needs sm_89 or newer); use auto or dequantize"
            )
    failures = []
    for matmul in candidates:
        failure = probe(matmul, accelerator.device, block)
        if failure is None:
            return Fp8Plan(matmul, f"{matmul} FP8 matmul on {accelerator.device}")
        failures.append(failure)
    if mode == "keep":
        raise EngineError(
            "AGENT_INFER_FP8_WEIGHTS=keep, but no FP8 matmul works here: " + "; ".join(failures)
        )
    return Fp8Plan(None, "dequantized at load: " + "; ".join(failures))


def hf_kernels(
    path: Path, device: torch.device, dtype: torch.dtype, mode: str | None = None
) -> tuple[Kernels, Fp8Linears | None]:
    """The torch kernels of an HF folder's model, with FP8 projections where :func:`plan_fp8` keeps
    them (the builder, returned too, records which weights it kept); ``mode`` defaults to the env."""
    kernels = torch_kernels(device, dtype)
    fmt = hf_quant_format(path)
    if fmt is None or fmt.block is None:
        return kernels, None
    plan = plan_fp8(mode or envs.fp8_weights(), accelerator_of(device), fmt.block)
    logger.info("%s: FP8 weights: %s", path, plan.reason)
    if plan.matmul is None:
        return kernels, None
    assert isinstance(kernels.linears, TorchLinears)
    builder = Fp8Linears(kernels.linears, hf_fp8_weight_names(path), fmt.block, plan.matmul)
    return dataclasses.replace(kernels, linears=builder), builder
