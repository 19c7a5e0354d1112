"""DeepSeek V4 decode rows on the native kernel: the windows they close, then their attention.

With the packed-float kernels (CPU, float32) a forward's single-token sequences have no per-sequence
views; :class:`~agent_infer.model.layers.compressed_plan.NativeDecode` holds them as batched tensors.
Per layer, :func:`close_windows` pools the entry of every window such a row completes (one native
call: a row's entry depends on its own window's states only), and
:func:`attend` runs every row's attention in one native call
(engine_native/src/kernels/attention_v4.cpp), which reads each row's own window, entries and
indexer choice and nothing else, so a row's bits do not depend on the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from agent_infer.errors import EngineError
from agent_infer.model.layers import native_deepseek, native_ops
from agent_infer.model.layers.compressed_plan import NativeDecode

if TYPE_CHECKING:
    from agent_infer.model.layers.compressed_attention import CompressedAttention, CompressorPools


def close_windows(
    layer: CompressedAttention,
    pools: CompressorPools,
    fresh: torch.Tensor,
    nd: NativeDecode,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the entry of the window each decode row completes (rows at a multiple of the rate) in
    one native call (engine_native/src/kernels/compressor.cpp): its ``rate`` (or, overlapping past
    window 0, ``2 * rate``) states, the earlier ones from the state pool, the row's own from
    ``fresh`` (the layer's new states, by row)."""
    comp = layer.compressor
    assert comp is not None
    rate = layer.rate
    closing = nd.closing(rate)
    if closing is None:
        return
    bs = nd.block_size
    span = 2 * rate - 1
    lead = closing.windows > 0 if comp.overlap else torch.zeros_like(closing.windows, dtype=torch.bool)
    state_slots = pools.state_slots(closing.token_slots, bs)
    if pools.positions is not None:
        used = torch.where(lead, span, rate - 1)
        read = torch.arange(span)[None, :] >= span - used[:, None]
        held = pools.positions.index_select(0, state_slots.view(-1)).view_as(state_slots)
        if not bool(((held == closing.positions) | ~read).all()):
            raise EngineError(
                f"{layer.prefix}: compressor states of a decode row's windows were overwritten: a draft "
                f"rolled back deeper than the {pools.ring}-token state ring allows (KVCache.allocate rollback)"
            )
    key = id(layer.rotary)
    if key not in closing.tables:
        closing.tables[key] = layer.rotary.tables(closing.windows * rate)
    cos, sin = closing.tables[key]
    targets = slot_mapping.index_select(0, closing.rows) // min(rate, bs)
    ix = layer.indexer.compressor if layer.indexer is not None else None
    states, entries = pools.states, pools.entries
    if not (
        all(t.dtype is torch.float32 and t.is_contiguous() for t in (states, entries, comp.ape, comp.norm))
        and fresh.dtype is torch.float32
        and fresh.stride(-1) == 1
        and (ix is None or (ix.ape.is_contiguous() and ix.norm.dtype is torch.float32))
    ):
        raise EngineError(f"{layer.prefix}: native window closes need contiguous float32 pools and weights")
    lead_bytes = lead.to(torch.uint8)
    slots = state_slots.contiguous()
    native_deepseek.close_windows(
        states.data_ptr(), int(states.shape[0]), int(states.shape[1]), slots.data_ptr(), int(slots.shape[0]),
        span, fresh.data_ptr(), int(fresh.stride(0)), closing.rows.data_ptr(), lead_bytes.data_ptr(),
        cos.data_ptr(), sin.data_ptr(), layer.rotary.rope_dim, targets.data_ptr(), entries.data_ptr(),
        int(entries.shape[0]), int(entries.shape[1]), rate, comp.overlap, comp.eps, comp.ape.data_ptr(),
        comp.norm.data_ptr(), comp.dim, 0 if ix is None else ix.ape.data_ptr(),
        0 if ix is None else ix.norm.data_ptr(), 0 if ix is None else ix.dim,
        work=int(slots.shape[0]) * span * 4 * (comp.dim + (0 if ix is None else ix.dim)),
    )  # fmt: skip


def attend(
    layer: CompressedAttention,
    batch: native_deepseek.V4DecodeBatch,
    q: torch.Tensor,
    window: torch.Tensor,
    entries: torch.Tensor | None,
    index: tuple[torch.Tensor, torch.Tensor] | None,
    out: torch.Tensor,
    keys: int = 0,
) -> None:
    """Every decode row's attention output into ``out`` ``[R, heads, dim]`` (float32, contiguous):
    ``q`` ``[R, heads, dim]`` rotated, ``window`` the layer's window pool, ``entries`` its entry pool
    (None on sliding-only layers), ``index`` the indexer's rotated queries ``[R, heads, dim]`` and
    head weights ``[R, heads]`` (sparse layers). ``keys``: the most keys the rows attend in all
    (``NativeDecode.keys``), which sizes the call's thread count; 0 takes the pool's."""
    tensors = [q, window, out, layer.sinks] + ([] if entries is None else [entries])
    if index is not None:
        tensors.append(index[0])
    if not all(
        t.dtype is torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in tensors
    ) or (index is not None and (index[1].dtype is not torch.float32 or index[1].stride(-1) != 1)):
        raise EngineError(
            f"{layer.prefix}: native V4 decode attention needs contiguous float32 CPU queries, pools and output"
        )
    ix = layer.indexer
    iq, iw = (0, 0) if index is None else (index[0].data_ptr(), index[1].data_ptr())
    per_key = 2 * layer.heads * layer.dim + (0 if ix is None or index is None else ix.heads * ix.dim)
    threads = native_ops.threads_for(keys * per_key) if keys else native_ops.get_num_threads()
    batch.run(
        q.data_ptr(), window.data_ptr(), 0 if entries is None else entries.data_ptr(), layer.sinks.data_ptr(),
        out.data_ptr(), layer.heads, layer.dim, 0 if entries is None else int(entries.shape[-1]), layer.scale,
        iq, 0 if index is None else int(index[0].stride(0)), iw, 0 if index is None else int(index[1].stride(0)),
        0 if ix is None else ix.heads, 0 if ix is None else ix.dim,
        0 if ix is None or index is None else ix.topk, 1.0 if ix is None else ix.score_scale,
        1.0 if ix is None else ix.weight_scale, threads,
    )  # fmt: skip
