"""The ranks' ``torch.distributed`` process group: gloo on the CPU, NCCL on NVIDIA, HCCL on Ascend.

The backend follows the accelerator the engine runs on. HCCL needs ``torch_npu`` (importing it
registers the backend); it has not been run here (no Ascend device was available). Ranks meet
through a TCP rendezvous on the front end's host; the same ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
``WORLD_SIZE`` variables torchrun sets are exported too, so code that reads them sees this layout.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from agent_infer.errors import AcceleratorUnavailableError, ConfigError

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True)
class GroupSpec:
    """Where ranks meet: ``world_size`` ranks, a rendezvous ``host:port``, a collective timeout."""

    world_size: int
    host: str
    port: int
    timeout_s: float


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the front end picks the rendezvous port with it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def backend_for(device: torch.device) -> str:
    """The collective backend for ``device``; raises :class:`AcceleratorUnavailableError` when the
    backend's runtime is missing."""
    name = _BACKENDS.get(device.type)
    if name is None:
        raise ConfigError(f"no collective backend for device type {device.type!r}")
    if name == "hccl":
        try:
            import torch_npu  # noqa: F401  (registers the hccl backend)
        except ImportError as exc:
            raise AcceleratorUnavailableError("the hccl backend needs torch_npu") from exc
    elif name == "nccl" and not dist.is_nccl_available():
        raise AcceleratorUnavailableError("this torch build has no NCCL")
    return name


def init_group(spec: GroupSpec, rank: int, device: torch.device) -> None:
    """Join the process group as ``rank`` (blocks until every rank has joined or the timeout)."""
    os.environ.update(
        MASTER_ADDR=spec.host, MASTER_PORT=str(spec.port), RANK=str(rank), WORLD_SIZE=str(spec.world_size)
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device),
        init_method=f"tcp://{spec.host}:{spec.port}",
        rank=rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.timeout_s),
    )


def close_group() -> None:
    """Leave the process group if joined."""
    if dist.is_initialized():
        dist.destroy_process_group()
