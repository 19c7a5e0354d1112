"""The collective backend follows the engine's accelerator (gloo on the CPU, nccl on NVIDIA, hccl
through torch_npu on Ascend), with a typed error when the backend's runtime is missing (the real ranks of
the other tests join a gloo group: ``test_expert_parallel.py`` checks it)."""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.distributed as dist

from agent_infer.accelerator import Accelerator, get_accelerator
from agent_infer.errors import AcceleratorUnavailableError, ConfigError
from agent_infer.parallel.group import backend_for


def _accelerator(name: str) -> Accelerator:
    # The choice reads the accelerator's name only, so a CPU device stands in for the others.
    return Accelerator(name, torch.device("cpu"))


def test_backend_follows_the_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    assert backend_for(get_accelerator("cpu")) == "gloo"
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    assert backend_for(_accelerator("nvidia")) == "nccl"
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    assert backend_for(_accelerator("ascend")) == "hccl"


def test_a_missing_backend_runtime_is_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(AcceleratorUnavailableError, match="nccl backend is not in this torch build"):
        backend_for(_accelerator("nvidia"))
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import torch_npu raises ImportError
    with pytest.raises(AcceleratorUnavailableError, match="needs the torch_npu package"):
        backend_for(_accelerator("ascend"))
    with pytest.raises(ConfigError, match="no collective backend for accelerator 'tpu'"):
        backend_for(_accelerator("tpu"))
