"""The CPU backend: the C++ kernel ``apply_token_bitmask_inplace_cpu`` in ``engine_native/src/kernels/bitmask.cpp``.

float32, C-contiguous logits only (what the engine's CPU path produces); it skips all-ones words
and releases the GIL while it runs.
"""

from __future__ import annotations

import torch

from agent_infer.native import load_native

NAME = "cpu"


def is_available(device: torch.device) -> bool:
    """True for CPU tensors when the C++ extension is built."""
    if device.type != "cpu":
        return False
    try:
        load_native()
    except ImportError:
        return False
    return True


def supports(logits: torch.Tensor) -> bool:
    """float32 C-contiguous CPU logits."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous()


def apply(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None) -> None:
    """Set disallowed logits to ``-inf`` in place through the C++ kernel."""
    native = load_native()
    native.apply_token_bitmask_inplace_cpu(
        logits, bitmask.contiguous(), None if indices is None else indices.contiguous()
    )
