"""The bitmask a fill writes into: how a caller's tensor or array is reached from the native side.

A C-contiguous int32 CPU torch tensor is written through its address (:func:`tensor_rows`); any
other target goes through DLPack or the buffer protocol after :func:`row_view` checked that a
fill would reach the caller's memory, and memory torch does not own is checked for writability
(:func:`foreign_memory`).
"""

from __future__ import annotations

import sys
from typing import Any

from agent_infer.errors import TokenBitmaskError


def row_view(bitmask: Any) -> Any:
    """The bitmask as a 2-D int32 CPU tensor/array the native side can write into.

    Raises ``TokenBitmaskError`` for one it could only fill through a copy (another dtype, rows
    that are not C-contiguous, a read-only array): the caller would never see the mask.
    """
    device = getattr(bitmask, "device", None)
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        raise TokenBitmaskError(
            f"token bitmasks are filled on the CPU (got a tensor on {device}); fill a CPU bitmask "
            "(allocate_token_bitmask) and copy it to the accelerator"
        )
    dtype = str(getattr(bitmask, "dtype", type(bitmask).__name__))
    if dtype not in ("torch.int32", "int32"):
        raise TokenBitmaskError(f"token bitmasks are int32 (got {dtype})")
    if bitmask.ndim == 1:
        bitmask = bitmask.unsqueeze(0) if hasattr(bitmask, "unsqueeze") else bitmask[None, :]
    if bitmask.ndim != 2:
        raise TokenBitmaskError(
            f"a token bitmask is 1-D or 2-D [rows, words] (got {bitmask.ndim} dimensions)"
        )
    flags = getattr(bitmask, "flags", None)
    contiguous = (
        bitmask.is_contiguous() if hasattr(bitmask, "is_contiguous") else bool(flags and flags.c_contiguous)
    )
    if not contiguous:
        raise TokenBitmaskError(
            "token bitmask rows must be C-contiguous (a column slice or transposed view is not)"
        )
    if flags is not None and not flags.writeable:
        raise TokenBitmaskError("token bitmask is read-only")
    return bitmask


def foreign_memory(bitmask: Any) -> bool:
    """Whether a tensor's memory needs its writability checked before a fill.

    Torch records none: ``torch.from_numpy`` of a read-only ``np.memmap`` wraps read-only pages,
    where a store kills the process. Storage torch allocated is resizable (until something else
    takes its address, e.g. ``.numpy()``) and writable; for other storage the native side asks
    the kernel about each row it fills. Memory that is writable but belongs to an immutable
    object (``torch.frombuffer`` of ``bytes``, which torch warns about when the tensor is made)
    cannot be told apart. Numpy arrays carry their own flag (checked by :func:`row_view`).
    """
    storage = getattr(bitmask, "untyped_storage", None)
    return storage is not None and not storage().resizable()


def tensor_rows(bitmask: Any) -> tuple[int, int, int, bool] | None:
    """(address, rows, words, foreign) of a C-contiguous 1-D or 2-D int32 CPU torch tensor, else None.

    Such a tensor is written through its address: DLPack, the general path (numpy arrays,
    other tensors, and every error message), costs about 2 µs per call, more than a cached fill.
    """
    torch = sys.modules.get("torch")
    if (
        torch is None
        or type(bitmask) is not torch.Tensor
        or bitmask.layout is not torch.strided
        or bitmask.dtype is not torch.int32
        or not bitmask.is_cpu
        or not bitmask.is_contiguous()
    ):
        return None
    # One shape read instead of dim() and shape: each torch attribute costs about 0.1 µs, and the
    # storage check below is one more.
    shape = bitmask.shape
    if len(shape) == 2:
        rows, words = shape
    elif len(shape) == 1:
        rows, words = 1, shape[0]
    else:
        return None
    if rows == 0 or words == 0:
        return None
    return bitmask.data_ptr(), rows, words, not bitmask.untyped_storage().resizable()
