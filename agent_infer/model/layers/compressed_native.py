"""DeepSeek V4 decode rows on the native kernel: the windows they close, then their attention.

With the packed-float kernels (CPU, float32) a forward's single-token sequences have no per-sequence
views; :class:`~agent_infer.model.layers.compressed_plan.NativeDecode` holds them as batched tensors.
Per layer, :func:`close_windows` pools the entry of every window such a row completes (the torch
compressor over all of them at once: a row's entry depends on its own window's states only), and
:func:`attend` runs every row's attention in one native call
(engine_native/src/kernels/attention_v4.cpp), which reads each row's own window, entries and
indexer choice and nothing else, so a row's bits do not depend on the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from agent_infer.errors import EngineError
from agent_infer.model.layers import native_ops
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
    """Write the entry of the window each decode row completes (rows at a multiple of the rate):
    its ``rate`` (or, overlapping past window 0, ``2 * rate``) states, the earlier ones from the
    state pool, the row's own from ``fresh`` (the layer's new states, by row)."""
    comp = layer.compressor
    assert comp is not None
    rate = layer.rate
    closing = (nd.ctx % rate == 0).nonzero().view(-1)
    if not int(closing.numel()):
        return
    windows = nd.ctx.index_select(0, closing) // rate - 1
    bs = nd.block_size
    # Overlapping compressors pool the previous window too, except at window 0.
    parts = (
        [(0, windows == 0), (1, windows > 0)]
        if comp.overlap
        else [(0, torch.ones_like(windows, dtype=torch.bool))]
    )
    for lead, pick in parts:
        members = closing[pick]
        if not int(members.numel()):
            continue
        ctx = nd.ctx.index_select(0, members)
        span = (1 + lead) * rate - 1  # earlier tokens pooled with each row's own
        positions = ctx[:, None] - 1 - span + torch.arange(span)[None, :]
        slots = pools.state_slots(nd.slots(members, positions), bs)
        if pools.positions is not None and span:
            held = pools.positions.index_select(0, slots.view(-1)).view_as(positions)
            if not bool((held == positions).all()):
                raise EngineError(
                    f"{layer.prefix}: compressor states of a decode row's windows were overwritten: a draft "
                    f"rolled back deeper than the {pools.ring}-token state ring allows (KVCache.allocate rollback)"
                )
        earlier = pools.states.index_select(0, slots.view(-1)).view(int(members.numel()), span, -1)
        rows = nd.rows.index_select(0, members)
        states = torch.cat((earlier, fresh.index_select(0, rows)[:, None].to(earlier.dtype)), dim=1)
        won = windows[pick]
        cw = comp.state_width
        new = comp.pool_each(states[..., :cw], won, lead, layer.rotary)
        if layer.indexer is not None:
            ic = layer.indexer.compressor
            new = torch.cat(
                (new, ic.pool_each(states[..., cw : cw + ic.state_width], won, lead, layer.rotary)), 1
            )
        targets = slot_mapping.index_select(0, rows) // min(rate, bs)
        pools.entries.index_copy_(0, targets, new.to(pools.entries.dtype))


def attend(
    layer: CompressedAttention,
    batch: native_ops.V4DecodeBatch,
    q: torch.Tensor,
    window: torch.Tensor,
    entries: torch.Tensor | None,
    index: tuple[torch.Tensor, torch.Tensor] | None,
    out: torch.Tensor,
) -> None:
    """Every decode row's attention output into ``out`` ``[R, heads, dim]`` (float32, contiguous):
    ``q`` ``[R, heads, dim]`` rotated, ``window`` the layer's window pool, ``entries`` its entry pool
    (None on sliding-only layers), ``index`` the indexer's rotated queries ``[R, heads, dim]`` and
    head weights ``[R, heads]`` (sparse layers)."""
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
    batch.run(
        q.data_ptr(), window.data_ptr(), 0 if entries is None else entries.data_ptr(), layer.sinks.data_ptr(),
        out.data_ptr(), layer.heads, layer.dim, 0 if entries is None else int(entries.shape[-1]), layer.scale,
        iq, 0 if index is None else int(index[0].stride(0)), iw, 0 if index is None else int(index[1].stride(0)),
        0 if ix is None else ix.heads, 0 if ix is None else ix.dim,
        0 if ix is None or index is None else ix.topk, 1.0 if ix is None else ix.score_scale,
        1.0 if ix is None else ix.weight_scale, native_ops.get_num_threads(),
    )  # fmt: skip
