"""Mask-apply kernels: one module per backend, imported only when first used.

Every backend module exposes the same three functions on *normalised* arguments (2-D logits with
unit stride in the vocabulary dimension, a 2-D int32 bitmask on the logits' device, and ``None`` or
1-D int64 row indices on that device, already range-checked where that needs no device sync):

* ``is_available(device)``: the backend's runtime is present for tensors on ``device``;
* ``supports(logits)``: it handles this dtype and layout;
* ``apply(logits, bitmask, indices)``: set logits whose bit is clear to ``-inf`` in place.

``cpu`` (the C++ kernel in ``engine_native``), ``torch`` (the reference; also Ascend through
torch_npu and any other device or dtype), ``triton`` and ``cuda`` (NVIDIA). The public entry point
and the argument checks live in :mod:`agent_infer.grammar.runtime.bitmask`; importing this package imports
no backend, so ``import agent_infer`` never pulls in Triton.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

import torch

from agent_infer.errors import ConfigError

BACKENDS = ("cpu", "torch", "triton", "cuda")

_MODULES = {
    "cpu": "agent_infer.grammar.runtime.kernels.cpu",
    "torch": "agent_infer.grammar.runtime.kernels.torch_ref",
    "triton": "agent_infer.grammar.runtime.kernels.triton",
    "cuda": "agent_infer.grammar.runtime.kernels.cuda",
}


def backend_module(name: str) -> ModuleType:
    """The module implementing backend ``name`` (one of :data:`BACKENDS`), imported on first use."""
    module = _MODULES.get(name)
    if module is None:
        raise ConfigError(f"unknown mask backend {name!r}; expected one of {', '.join(BACKENDS)}")
    return importlib.import_module(module)


def available(name: str, device: torch.device) -> bool:
    """Whether backend ``name`` can run on ``device`` here, without compiling or launching anything."""
    if name == "triton" and (device.type != "cuda" or importlib.util.find_spec("triton") is None):
        return False  # checked before importing the module, which imports triton
    try:
        module = backend_module(name)
    except ImportError:
        return False
    return bool(module.is_available(device))


__all__ = ["BACKENDS", "available", "backend_module"]
