"""The ranks' ``torch.distributed`` process group: gloo on the CPU, NCCL on NVIDIA, HCCL on Ascend.

The backend follows the engine's accelerator (``accelerator.py``, ``AGENT_INFER_ACCELERATOR``), and
:func:`backend_for` is the one place that maps one to the other. HCCL needs ``torch_npu`` (importing
it registers the backend). Only gloo has been run here: NCCL and HCCL are written against the same
``torch.distributed`` calls but untested (no multi-GPU or Ascend machine was available). Ranks meet
through a TCP rendezvous on the front end's host; the same ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/
``WORLD_SIZE`` variables torchrun sets are exported too, so code that reads them sees this layout.
"""

from __future__ import annotations

import importlib
import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from agent_infer.accelerator import Accelerator
from agent_infer.errors import AcceleratorUnavailableError, ConfigError

#: Accelerator name (``Accelerator.name``) -> collective backend.
BACKENDS = {"cpu": "gloo", "nvidia": "nccl", "ascend": "hccl"}


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


def backend_for(accelerator: Accelerator) -> str:
    """The collective backend of ``accelerator``: gloo (cpu), nccl (nvidia), hccl (ascend). Raises
    :class:`AcceleratorUnavailableError` when the backend's runtime is missing (a torch build without
    NCCL, no ``torch_npu``) and :class:`ConfigError` for an accelerator without one."""
    name = BACKENDS.get(accelerator.name)
    if name is None:
        raise ConfigError(
            f"no collective backend for accelerator {accelerator.name!r}; known: {', '.join(BACKENDS)}"
        )
    if name == "hccl":
        try:
            importlib.import_module("torch_npu")  # registers the hccl backend
        except ImportError as exc:
            raise AcceleratorUnavailableError("the hccl backend needs the torch_npu package") from exc
    elif name == "nccl" and not dist.is_nccl_available():
        raise AcceleratorUnavailableError(
            f"the nccl backend is not in this torch build ({torch.__version__}); install a CUDA build of torch"
        )
    return name


def init_group(spec: GroupSpec, rank: int, accelerator: Accelerator) -> None:
    """Join the process group as ``rank`` over ``accelerator``'s backend (blocks until every rank has
    joined or the timeout)."""
    backend = backend_for(accelerator)
    os.environ.update(
        MASTER_ADDR=spec.host, MASTER_PORT=str(spec.port), RANK=str(rank), WORLD_SIZE=str(spec.world_size)
    )
    accelerator.set_device()
    dist.init_process_group(
        backend,
        init_method=f"tcp://{spec.host}:{spec.port}",
        rank=rank,
        world_size=spec.world_size,
        timeout=timedelta(seconds=spec.timeout_s),
    )


def close_group() -> None:
    """Leave the process group if joined."""
    if dist.is_initialized():
        dist.destroy_process_group()
