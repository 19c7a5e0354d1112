"""Package-level plumbing: environment variables, the accelerator switch, the native extension."""

from __future__ import annotations

import pytest
import torch

from agent_infer import envs
from agent_infer.accelerator import get_accelerator
from agent_infer.errors import AcceleratorUnavailableError, AgentInferError, ConfigError
from agent_infer.native import load_native, require_native


def test_accelerator_cpu_explicit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_INFER_ACCELERATOR", "cpu")
    acc = get_accelerator()
    assert acc.name == "cpu" and acc.device == torch.device("cpu") and acc.is_cpu
    acc.synchronize()
    assert acc.memory_free_bytes() is None


def test_accelerator_auto_falls_back_to_cpu_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: auto picks nvidia here")
    monkeypatch.setenv("AGENT_INFER_ACCELERATOR", "auto")
    assert get_accelerator().name == "cpu"


@pytest.mark.parametrize("name, missing", [("nvidia", "CUDA"), ("ascend", "torch_npu")])
def test_missing_accelerator_runtime_is_named(
    monkeypatch: pytest.MonkeyPatch, name: str, missing: str
) -> None:
    if name == "nvidia" and torch.cuda.is_available():
        pytest.skip("CUDA present")
    monkeypatch.setenv("AGENT_INFER_ACCELERATOR", name)
    with pytest.raises(AcceleratorUnavailableError, match=missing) as info:
        get_accelerator()
    assert isinstance(info.value, AgentInferError)


def test_bad_env_values_raise_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_INFER_ACCELERATOR", "tpu")
    with pytest.raises(ConfigError, match="AGENT_INFER_ACCELERATOR"):
        envs.accelerator()
    monkeypatch.setenv("AGENT_INFER_ASYNC_SCHEDULING", "maybe")
    with pytest.raises(ConfigError, match="AGENT_INFER_ASYNC_SCHEDULING"):
        envs.async_scheduling()
    monkeypatch.setenv("AGENT_INFER_NUM_THREADS", "-3")
    with pytest.raises(ConfigError, match=">= 0"):
        envs.num_threads()


def test_native_extension_loads_and_masks() -> None:
    native = load_native()
    apply = require_native("bitmask", "apply_token_bitmask_inplace_cpu")
    logits = torch.zeros(2, 70)
    mask = torch.zeros(2, 3, dtype=torch.int32)
    mask[0, 0] = 0b101
    mask[1, 2] = 1 << 3  # token 67
    apply(logits, mask)  # type: ignore[operator]
    allowed = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert allowed == [[0, 2], [67]]
    assert native.ABI_VERSION == 1


def test_require_native_names_missing_attribute() -> None:
    from agent_infer.errors import NativeExtensionMissingError

    with pytest.raises(NativeExtensionMissingError, match="no_such_kernel"):
        require_native("a feature", "no_such_kernel")
