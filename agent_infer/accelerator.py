"""The accelerator switch: one small interface over cpu, CUDA (nvidia) and Ascend (npu via torch_npu).

``AGENT_INFER_ACCELERATOR=auto|cpu|nvidia|ascend`` picks the backend. All device-specific calls
(synchronize, streams, memory queries) go through :class:`Accelerator`, so the rest of the engine
never imports ``torch.cuda`` or ``torch_npu`` directly.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

from agent_infer import envs
from agent_infer.errors import AcceleratorUnavailableError, ConfigError


@dataclass(frozen=True)
class Accelerator:
    """A resolved backend: ``name`` is cpu | nvidia | ascend; ``device`` is the torch device."""

    name: str
    device: torch.device

    def synchronize(self) -> None:
        """Wait for queued device work; a no-op on CPU."""
        if self.name == "nvidia":
            torch.cuda.synchronize(self.device)
        elif self.name == "ascend":
            torch.npu.synchronize(self.device)  # type: ignore[attr-defined]

    def set_device(self) -> None:
        """Make ``device`` the process's current device (what NCCL/HCCL collectives use); a no-op on CPU."""
        if self.name == "nvidia":
            torch.cuda.set_device(self.device)
        elif self.name == "ascend":
            torch.npu.set_device(self.device)  # type: ignore[attr-defined]

    def memory_free_bytes(self) -> int | None:
        """Free device memory in bytes, or None where the backend cannot say (CPU)."""
        if self.name == "nvidia":
            free, _total = torch.cuda.mem_get_info(self.device)
            return int(free)
        if self.name == "ascend":
            free, _total = torch.npu.mem_get_info(self.device)  # type: ignore[attr-defined]
            return int(free)
        return None

    def fp8_matmuls(self) -> tuple[str, ...]:
        """The FP8 matmuls the device runs in hardware, fastest first (layers/fp8_linear.py): on NVIDIA,
        ``per_group`` (row-wise scaled FP8) from sm_89, ``blockwise`` (1x128 / 128x128 scales) on
        sm_90 with a torch that has it; none on the CPU and on Ascend."""
        if self.name != "nvidia":
            return ()
        capability = torch.cuda.get_device_capability(self.device)
        found: list[str] = []
        scaling = getattr(torch.nn.functional, "ScalingType", None)
        if capability == (9, 0) and hasattr(scaling, "BlockWise128x128"):
            found.append("blockwise")
        if capability >= (8, 9):
            found.append("per_group")
        return tuple(found)

    @property
    def is_cpu(self) -> bool:
        """True when tensors live in host memory."""
        return self.name == "cpu"


def _cuda_available() -> bool:
    return bool(torch.cuda.is_available())


def _npu_available() -> bool:
    try:
        importlib.import_module("torch_npu")
    except ImportError:
        return False
    return bool(getattr(torch, "npu", None) is not None and torch.npu.is_available())  # type: ignore[attr-defined]


def get_accelerator(requested: str | None = None) -> Accelerator:
    """Resolve ``requested`` (or ``AGENT_INFER_ACCELERATOR``) to an :class:`Accelerator`.

    ``auto`` prefers CUDA, then Ascend, then CPU. Asking explicitly for a backend whose runtime is
    missing raises :class:`AcceleratorUnavailableError` naming what is missing.
    """
    name = (requested or envs.accelerator()).lower()
    if name == "auto":
        if _cuda_available():
            name = "nvidia"
        elif _npu_available():
            name = "ascend"
        else:
            name = "cpu"
    if name == "cpu":
        return Accelerator("cpu", torch.device("cpu"))
    if name == "nvidia":
        if not _cuda_available():
            raise AcceleratorUnavailableError(
                "AGENT_INFER_ACCELERATOR=nvidia but CUDA is unavailable: this torch build "
                f"({torch.__version__}, CUDA {torch.version.cuda}) sees no CUDA device; install a CUDA build "
                "of torch and an NVIDIA driver, or use AGENT_INFER_ACCELERATOR=cpu"
            )
        return Accelerator("nvidia", torch.device("cuda", torch.cuda.current_device()))
    if name == "ascend":
        try:
            importlib.import_module("torch_npu")
        except ImportError:
            raise AcceleratorUnavailableError(
                "AGENT_INFER_ACCELERATOR=ascend but the torch_npu package is not installed; install "
                "torch_npu matching your CANN toolkit, or use AGENT_INFER_ACCELERATOR=cpu"
            ) from None
        if not _npu_available():
            raise AcceleratorUnavailableError(
                "AGENT_INFER_ACCELERATOR=ascend: torch_npu is installed but reports no available NPU "
                "(is the CANN driver loaded?)"
            )
        return Accelerator("ascend", torch.device("npu", 0))
    raise ConfigError(f"unknown accelerator {name!r}; expected auto, cpu, nvidia or ascend")
