"""Lossless re-encoding of GGUF 32-value blocks as Q8_0, so fused projections of mixed types stay packed.

A ``Q4_K_M`` file stores q and k in Q5_0 but v in Q8_0 on some layers (llama.cpp's per-tensor type
choice); fusing them into one packed q/k/v matrix needs one block type. Q4_0 and Q5_0 codes minus their
offset (-8..7, -16..15) fit Q8_0's int8 codes with the same fp16 scale, and every dequantized value is
``fl(d * q)`` in all three, so the re-encoded tensor dequantizes to exactly the same float32 values.
"""

from __future__ import annotations

import torch

from agent_infer.errors import ModelLoadError

Q4_0, Q5_0, Q8_0 = 2, 6, 8
#: ggml types :func:`to_q8_0` re-encodes exactly.
Q8_COMPATIBLE = frozenset({Q4_0, Q5_0, Q8_0})
_BLOCK_BYTES = {Q4_0: 18, Q5_0: 22, Q8_0: 34}
_SHIFTS = torch.arange(32, dtype=torch.int32)


def to_q8_0(raw: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """Rows ``[rows, row_bytes]`` of Q4_0/Q5_0/Q8_0 blocks as Q8_0 rows ``[rows, k / 32 * 34]`` (same values)."""
    if ggml_type not in _BLOCK_BYTES:
        raise ModelLoadError(f"cannot re-encode ggml type {ggml_type} as Q8_0 (only Q4_0, Q5_0, Q8_0)")
    rows = raw.shape[0]
    if ggml_type == Q8_0:
        return raw
    b = raw.reshape(-1, _BLOCK_BYTES[ggml_type])
    qs = b[:, -16:]
    # ggml's nibble order: low nibbles are values 0..15, high nibbles 16..31
    q = torch.cat((qs & 15, qs >> 4), dim=1).to(torch.int16)
    if ggml_type == Q5_0:
        high = b[:, 2:6].contiguous().view(torch.int32)  # bit i is value i's fifth bit
        q |= (((high >> _SHIFTS) & 1) << 4).to(torch.int16)
        q -= 16
    else:
        q -= 8
    codes = q.to(torch.int8).view(torch.uint8)
    return torch.cat((b[:, :2], codes), dim=1).reshape(rows, -1)
