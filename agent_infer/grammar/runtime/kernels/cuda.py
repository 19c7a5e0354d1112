"""The CUDA backend: ``engine_native/cuda/apply_token_bitmask.cu``, compiled at first use.

The source is not part of the CMake build (the wheel must build on machines without nvcc): the
first call compiles it with ``torch.utils.cpp_extension.load`` into
``<AGENT_INFER_CACHE_DIR>/kernels/<torch and CUDA versions>/`` and registers the op
``torch.ops.agent_infer_kernels.apply_token_bitmask``; later processes reuse the cached library
(cpp_extension rebuilds only when the source or flags change). One block per (row, 256 tokens).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from agent_infer import envs
from agent_infer.errors import AcceleratorUnavailableError

NAME = "cuda"

SOURCE = Path(__file__).resolve().parents[4] / "engine_native" / "cuda" / "apply_token_bitmask.cu"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_lock = threading.Lock()
_op: Any = None
_build_error: str | None = None


def _cuda_home() -> str | None:
    from torch.utils import cpp_extension

    return cpp_extension.CUDA_HOME


def is_available(device: torch.device) -> bool:
    """CUDA tensors, a CUDA toolkit (nvcc) for the first build, and the kernel source on disk."""
    return device.type == "cuda" and SOURCE.is_file() and _cuda_home() is not None and _build_error is None


def supports(logits: torch.Tensor) -> bool:
    """float32 / float16 / bfloat16 logits with unit stride in the vocabulary dimension."""
    return logits.dtype in _DTYPES and logits.stride(-1) == 1


def build_directory() -> Path:
    """Where the compiled kernel is cached, keyed by the torch and CUDA versions it was built for."""
    tag = f"torch{torch.__version__}-cuda{torch.version.cuda}".replace("+", "_")
    return envs.cache_dir() / "kernels" / tag


def load_op() -> Any:
    """Compile (or reuse the cached build of) the kernel and return the registered torch op."""
    global _op, _build_error
    with _lock:
        if _op is not None:
            return _op
        if _build_error is not None:
            raise AcceleratorUnavailableError(_build_error)
        if not SOURCE.is_file():
            _build_error = (
                f"the CUDA mask kernel source {SOURCE} is missing (it ships with the source tree; install "
                "agent-infer from a checkout, or use AGENT_INFER_MASK_BACKEND=triton or torch)"
            )
            raise AcceleratorUnavailableError(_build_error)
        if _cuda_home() is None:
            _build_error = (
                "the CUDA mask kernel is compiled at first use and needs the CUDA toolkit (nvcc; set "
                "CUDA_HOME); none was found. Use AGENT_INFER_MASK_BACKEND=triton or torch instead"
            )
            raise AcceleratorUnavailableError(_build_error)
        from torch.utils import cpp_extension

        directory = build_directory()
        directory.mkdir(parents=True, exist_ok=True)
        try:
            cpp_extension.load(
                name="agent_infer_bitmask_cuda",
                sources=[str(SOURCE)],
                build_directory=str(directory),
                extra_cuda_cflags=["-O3"],
                is_python_module=False,
                verbose=False,
            )
        except Exception as exc:  # compiler errors come back as RuntimeError/OSError/CalledProcessError
            _build_error = f"building the CUDA mask kernel {SOURCE.name} in {directory} failed: {exc}"
            raise AcceleratorUnavailableError(_build_error) from exc
        _op = torch.ops.agent_infer_kernels.apply_token_bitmask
        return _op


def apply(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None) -> None:
    """Set disallowed logits to ``-inf`` in place with one kernel launch."""
    op = _op if _op is not None else load_op()  # no lock on the hot path once built
    if logits.is_inference() and not torch.is_inference_mode_enabled():
        # The dispatcher refuses in-place ops on inference tensors outside inference_mode.
        with torch.inference_mode():
            op(logits, bitmask, indices)
        return
    op(logits, bitmask, indices)
