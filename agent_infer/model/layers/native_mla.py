"""DeepSeek V3's multi-head latent attention kernels of the C++ extension: the inputs of a layer
(latent norm, rotations, cache rows) and the absorbed attention of chunks of query rows (the decode
rows' kernel is ``native_ops.DecodeBatch.run_mla``). Hot entry points take raw addresses; each
wrapper documents and checks what the kernel relies on.
"""

from __future__ import annotations

from typing import Protocol

import torch

from agent_infer.model.layers.native_ops import extension


def mla_prep(
    q: torch.Tensor, h: torch.Tensor, lat_off: int, lora: int, norm_weight: torch.Tensor, eps: float,
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor], interleave: bool, cache: torch.Tensor,
    slots: torch.Tensor, n: int,
) -> torch.Tensor:  # fmt: skip
    """DeepSeek V3's MLA inputs of one layer: writes the ``n`` new tokens' latent cache rows (normed
    latent, rotated key, from ``h``'s columns ``lat_off ..``) at ``slots`` and returns the rotated
    rope parts of ``q`` (``[R, heads, nope + rope]``) as ``[R, heads, rope]``
    (engine_native/src/kernels/rope.cpp)."""
    rows, heads, width = (int(d) for d in q.shape)
    rope = int(cache.shape[1]) - lora
    cos, sin, pos = tables
    ok = (
        all(t.dtype is torch.float32 and t.device.type == "cpu" for t in (q, h, norm_weight, cache, cos, sin))
        and q.stride(2) == 1
        and h.stride(1) == 1
        and cache.is_contiguous()
        and cos.is_contiguous()
        and sin.is_contiguous()
        and norm_weight.is_contiguous()
        and int(norm_weight.numel()) == lora
        and pos.dtype is torch.int64
        and pos.is_contiguous()
        and int(pos.shape[0]) >= rows
        and slots.dtype is torch.int64
        and int(slots.shape[0]) == n
    )
    if not ok:
        raise ValueError(
            "mla_prep: inputs must be float32 CPU rows with contiguous tables, int64 positions and slots"
        )
    slots = slots.contiguous()
    qr = torch.empty(rows, heads, rope)
    extension().mla_prep(
        q.data_ptr(), int(q.stride(0)), int(q.stride(1)), heads, width - rope, rope, h.data_ptr(), int(h.stride(0)),
        lat_off, lora, norm_weight.data_ptr(), eps, cos.data_ptr(), sin.data_ptr(), int(cos.shape[0]),
        pos.data_ptr(), interleave, cache.data_ptr(), int(cache.shape[0]), slots.data_ptr(), rows, n, qr.data_ptr(),
    )  # fmt: skip
    return qr


class MlaRowsSet(Protocol):
    """What ``_native.MlaRows`` offers: a step's chunks checked once, run per layer with
    ``DecodeBatch.run_mla``'s arguments; each row bit-identical to that kernel's."""

    num_tiles: int

    def run(
        self, q_nope: int, q_rope: int, cache: int, kv_b: int, out: int, heads: int, nope: int, rope: int,
        lora: int, v: int, scale: float, num_threads: int, qn_row: int, qn_head: int, qr_row: int, qr_head: int,
    ) -> None: ...  # fmt: skip


def mla_rows(seqs: torch.Tensor, slots: torch.Tensor, num_rows: int, num_slots: int) -> MlaRowsSet:
    """Absorbed-MLA chunks (engine_native/src/kernels/attention_mla_rows.cpp): ``seqs`` int64 ``[S, 3]``
    = (first row, rows, context length), the rows being the context's last; ``slots`` int64, each
    sequence's cache slots in position order, concatenated. Rows below ``num_rows`` and slots below
    ``num_slots`` are checked natively (``IndexError``; bad spans ``ValueError``)."""
    if seqs.dtype is not torch.int64 or slots.dtype is not torch.int64:
        raise ValueError(f"mla_rows: seqs and slots must be int64, got {seqs.dtype} and {slots.dtype}")
    rows: MlaRowsSet = extension().MlaRows(
        seqs.cpu().contiguous(), slots.cpu().contiguous(), num_rows, num_slots
    )
    return rows
