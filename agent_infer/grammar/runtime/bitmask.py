"""Token bitmasks: allocation, and application to logits through the backend that fits the tensors.

Layout: int32 ``[batch, ceil(vocab / 32)]``; bit ``j`` of word ``w`` allows token ``32 * w + j``.
Backends live in :mod:`agent_infer.grammar.runtime.kernels` (``docs/kernels.md``): the C++ kernel for
float32 CPU logits, Triton (else the CUDA kernel) on NVIDIA, the torch reference elsewhere
(Ascend, other dtypes). ``AGENT_INFER_MASK_BACKEND`` forces one.
"""

from __future__ import annotations

import operator
import threading
import warnings
from collections.abc import Sequence

import torch

from agent_infer import envs
from agent_infer.errors import AcceleratorUnavailableError, TokenBitmaskError
from agent_infer.grammar.runtime.kernels import available, backend_module
from agent_infer.grammar.runtime.kernels.torch_ref import apply as _torch_apply

Indices = Sequence[int] | torch.Tensor | None

# Availability per (backend, device) is stable for the life of a process; so is a GPU backend that
# failed on its first launch (no toolkit, unsupported GPU), which auto mode then stops trying.
_available: dict[tuple[str, str], bool] = {}
_verified: set[tuple[str, str]] = set()
_broken: dict[tuple[str, str], str] = {}
_state_lock = threading.Lock()


def bitmask_words(vocab_size: int) -> int:
    """Number of int32 words per row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def allocate_token_bitmask(batch_size: int, vocab_size: int) -> torch.Tensor:
    """An all-ones (allow everything) int32 bitmask of shape ``[batch_size, ceil(vocab_size / 32)]``.

    ``batch_size`` >= 0 and 1 <= ``vocab_size`` < 2**31 (token ids are int32), else TokenBitmaskError.
    """
    rows = _count(batch_size, "batch_size", 0)
    vocab = _count(vocab_size, "vocab_size", 1)
    return torch.full((rows, bitmask_words(vocab)), -1, dtype=torch.int32)


def _count(value: object, name: str, low: int) -> int:
    """``value`` as an int in [low, 2**31), else a TokenBitmaskError naming ``name``."""
    if isinstance(value, bool):
        raise TokenBitmaskError(f"{name} must be an int, got a bool")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TokenBitmaskError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if not low <= number < 2**31:
        raise TokenBitmaskError(f"{name} must be in [{low}, 2**31), got {number}")
    return number


def _index_tensor(indices: Sequence[int] | torch.Tensor, limit: int, where: str) -> torch.Tensor:
    """Row indices as a 1-D int64 tensor (on the device they came on); host indices are range-checked."""
    if isinstance(indices, torch.Tensor):
        if indices.dtype == torch.bool or indices.is_floating_point() or indices.is_complex():
            raise TokenBitmaskError(f"indices must be integers, got a {indices.dtype} tensor")
        idx = indices.reshape(-1).to(torch.int64)
        if idx.device.type == "cpu" and idx.numel():
            low, high = int(idx.min()), int(idx.max())
            if low < 0 or high >= limit:
                bad = low if low < 0 else high
                raise TokenBitmaskError(f"indices contain {bad}, outside the {limit} rows of {where}")
        return idx
    if isinstance(indices, (str, bytes)) or not hasattr(indices, "__iter__"):
        raise TokenBitmaskError(
            f"indices must be a sequence of ints or a tensor, got {type(indices).__name__}"
        )
    values = []
    for i, value in enumerate(indices):
        try:
            if isinstance(value, bool):
                raise TypeError
            number = operator.index(value)
        except TypeError:
            raise TokenBitmaskError(f"indices[{i}] = {value!r} is not an int") from None
        if not 0 <= number < limit:
            raise TokenBitmaskError(f"indices[{i}] = {number} is outside the {limit} rows of {where}")
        values.append(number)
    return torch.tensor(values, dtype=torch.int64)


def normalise_arguments(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: Indices
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Check the arguments and return what every backend takes: 2-D logits, a contiguous 2-D int32
    bitmask and ``None`` or 1-D int64 indices, all on the logits' device."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() not in (1, 2):
        described = (
            f"{logits.dtype} tensor of shape {tuple(logits.shape)}"
            if isinstance(logits, torch.Tensor)
            else type(logits).__name__
        )
        raise TokenBitmaskError(f"logits must be a 1-D or 2-D floating tensor, got a {described}")
    if not isinstance(bitmask, torch.Tensor) or bitmask.dtype != torch.int32 or bitmask.dim() not in (1, 2):
        described = (
            f"{bitmask.dtype} tensor of shape {tuple(bitmask.shape)}"
            if isinstance(bitmask, torch.Tensor)
            else type(bitmask).__name__
        )
        raise TokenBitmaskError(f"bitmask must be a 1-D or 2-D int32 tensor, got a {described}")
    view = logits.unsqueeze(0) if logits.dim() == 1 else logits
    mask = bitmask.unsqueeze(0) if bitmask.dim() == 1 else bitmask
    if mask.device != view.device:
        mask = mask.to(view.device)
    mask = mask.contiguous()
    shapes = f"logits shape {tuple(logits.shape)}, bitmask shape {tuple(bitmask.shape)}"
    if indices is None:
        if mask.shape[0] != view.shape[0]:
            raise TokenBitmaskError(
                f"bitmask has {mask.shape[0]} rows but logits have {view.shape[0]} ({shapes}); "
                "pass indices to mask selected rows"
            )
        return view, mask, None
    idx = _index_tensor(indices, min(view.shape[0], mask.shape[0]), f"both tensors ({shapes})")
    if idx.device != view.device:
        idx = idx.to(view.device)
    return view, mask, idx.contiguous()


def _candidates(logits: torch.Tensor) -> tuple[str, ...]:
    """Backends auto mode tries for these logits, best first; torch (always able) ends every list."""
    if logits.device.type == "cpu":
        return ("cpu", "torch") if logits.dtype == torch.float32 and logits.is_contiguous() else ("torch",)
    if logits.device.type == "cuda":
        return ("triton", "cuda", "torch")
    return ("torch",)


def _is_available(name: str, device: torch.device) -> bool:
    key = (name, str(device))
    known = _available.get(key)
    if known is None:
        known = available(name, device)
        _available[key] = known
    return known


def select_backend(logits: torch.Tensor) -> str:
    """The backend :func:`apply_token_bitmask_inplace` would use for ``logits`` (2-D) right now."""
    forced = envs.mask_backend()
    if forced != "auto":
        return forced
    for name in _candidates(logits):
        key = (name, str(logits.device))
        if key in _broken or not _is_available(name, logits.device):
            continue
        if name == "torch" or backend_module(name).supports(logits):
            return name
    return "torch"


def _run_forced(name: str, logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None) -> None:
    if not _is_available(name, logits.device):
        raise AcceleratorUnavailableError(
            f"AGENT_INFER_MASK_BACKEND={name} cannot run on {logits.device} here (see docs/kernels.md for "
            "what each backend needs); use auto"
        )
    module = backend_module(name)
    if not module.supports(logits):
        raise TokenBitmaskError(
            f"mask backend {name!r} does not support {logits.dtype} logits of shape {tuple(logits.shape)} "
            f"and strides {logits.stride()} on {logits.device}"
        )
    module.apply(logits, bitmask, indices)


def apply_token_bitmask_inplace(logits: torch.Tensor, bitmask: torch.Tensor, indices: Indices = None) -> None:
    """Set disallowed logits to ``-inf`` in place; ``indices`` selects rows (same row in logits and mask).

    ``logits`` is ``[batch, vocab]`` or ``[vocab]`` of any floating dtype; ``bitmask`` is int32
    ``[rows, words]`` (moved to the logits' device if it is elsewhere). Tokens at or past
    ``32 * words`` are masked; bits past ``vocab`` are ignored. Bad shapes, dtypes or host-side
    indices raise :class:`~agent_infer.errors.TokenBitmaskError` naming them.
    """
    view, mask, idx = normalise_arguments(logits, bitmask, indices)
    forced = envs.mask_backend()
    if forced != "auto":
        _run_forced(forced, view, mask, idx)
        return
    name = select_backend(view)
    if name == "torch":
        _torch_apply(view, mask, idx)
        return
    key = (name, str(view.device))
    if key in _verified or name == "cpu":
        backend_module(name).apply(view, mask, idx)
        return
    try:
        backend_module(name).apply(view, mask, idx)
    except Exception as exc:
        # First launch of a GPU backend: a missing toolkit or an unsupported GPU must not take
        # constrained decoding down; the next backend (torch at worst) takes over. A backend's partial
        # work is harmless: masking twice gives the same logits.
        with _state_lock:
            _broken[key] = f"{type(exc).__name__}: {exc}"
        warnings.warn(
            f"mask backend {name!r} failed on {view.device} and is disabled for this process "
            f"({_broken[key]}); falling back",
            RuntimeWarning,
            stacklevel=2,
        )
        apply_token_bitmask_inplace(view, mask, idx)
        return
    with _state_lock:
        _verified.add(key)


def apply_token_bitmask_rows(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], *, backend: str | None = None
) -> None:
    """:func:`apply_token_bitmask_inplace` for rows ``rows`` (a list; same row in logits and mask).

    The engine's path: float32 C-contiguous CPU logits go straight to the C++ kernel (no index
    tensor, no backend lookup) unless the backend setting (``backend``, default
    ``AGENT_INFER_MASK_BACKEND`` read now) forces another; other logits take
    :func:`apply_token_bitmask_inplace`, the bitmask moved to their device. Rows outside either
    tensor raise :class:`~agent_infer.errors.TokenBitmaskError`.
    """
    if backend is None:
        backend = envs.mask_backend()
    if (
        logits.dtype is torch.float32
        and logits.is_cpu
        and logits.dim() == 2
        and logits.is_contiguous()
        and bitmask.dtype is torch.int32
        and bitmask.is_cpu
        and bitmask.dim() == 2
        and bitmask.is_contiguous()
        and backend in ("auto", "cpu")
        and _is_available("cpu", logits.device)
    ):
        from agent_infer.native import load_native

        try:
            load_native().apply_token_bitmask_rows_cpu(logits, bitmask, rows)
        except IndexError as exc:
            raise TokenBitmaskError(str(exc)) from None
        return
    if logits.device.type == "cpu":
        apply_token_bitmask_inplace(logits, bitmask, rows)
        return
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True), index)


def apply_token_bitmask_inplace_torch(
    logits: torch.Tensor, bitmask: torch.Tensor, indices: Indices = None
) -> None:
    """The torch reference backend, with the same argument checks as :func:`apply_token_bitmask_inplace`."""
    view, mask, idx = normalise_arguments(logits, bitmask, indices)
    _torch_apply(view, mask, idx)


__all__ = [
    "allocate_token_bitmask",
    "apply_token_bitmask_inplace",
    "apply_token_bitmask_inplace_torch",
    "apply_token_bitmask_rows",
    "bitmask_words",
    "normalise_arguments",
    "select_backend",
]
