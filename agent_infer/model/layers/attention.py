"""Paged attention over the engine's block-table KV cache: the torch (SDPA) and native decode backends.

Each sequence's attention is computed on its own, with exactly the same tensor shapes whether it
runs alone or in a batch: that is what makes logits batch invariant (see
tests/model/test_batch_invariance.py). The loader picks the backend once: :class:`PagedAttention`
runs every sequence through SDPA; :class:`NativePagedAttention` sends every row of every chunk to the
native kernel (engine_native/src/kernels/attention.cpp), each row computed as decoding that token
alone would, consecutive rows of a sequence tiled to share key and value loads.

A plan made with a ``sliding_window`` W lets the query at position p see only keys in
``(p - W, p]`` (HF's and llama.cpp's convention); a family with layers of different windows makes
one plan per window. The native kernel attends to a row's context in table order whatever the
block size, so a row whose window cuts its context gets a table of single slots (block size 1)
listing the window's keys: the same kernel, the same arithmetic over fewer keys.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from agent_infer.errors import EngineError
from agent_infer.model.layers import native_ops


@dataclass
class AttentionMetadata:
    """One flattened batch of new tokens from ``B`` sequences.

    ``query_start_loc`` has ``B+1`` entries: the tokens of sequence ``i`` are input rows
    ``[query_start_loc[i], query_start_loc[i+1])``. ``context_lens[i]`` is sequence ``i``'s KV
    length *after* this step (cached + new). ``block_tables[i]`` lists its physical KV blocks in
    order. ``slot_mapping`` (int64 ``[N]``) is the KV slot ``block_id*block_size + offset`` of each new token.
    """

    query_start_loc: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    slot_mapping: torch.Tensor
    block_size: int


@dataclass
class _SeqPlan:
    start: int
    end: int
    gather: torch.Tensor  # KV slots of the whole context, in position order
    mask: torch.Tensor | None  # bool [q_len, ctx], True = may attend; None when no mask is needed
    causal: bool  # True when q_len == ctx (plain prefill): SDPA's own causal mask is exact


@dataclass
class _DecodePlan:
    """Query rows handled by one native kernel call per layer (CPU float32 only)."""

    rows: torch.Tensor  # int64 [B]: each sequence's query row
    tables: torch.Tensor  # int64 [B, max_blocks], or [chunks, max_blocks] with table_rows
    context_lens: torch.Tensor  # int64 [B]
    block_size: int
    #: The same sequences checked once natively for every layer's call.
    native: native_ops.DecodeBatch
    num_slots: int
    #: int64 [B]: the row of ``tables`` each entry uses (None: its own).
    table_rows: torch.Tensor | None = None
    #: Keys the rows attend in all (the sum of their context lengths): a call's size, for its threads.
    keys: int = 0


@dataclass
class AttentionPlan:
    """Per-forward precomputation shared by all layers: gather indices and masks per sequence.

    ``seqs`` go through SDPA one by one; ``decode`` (when set) covers the single-token sequences
    left out of ``seqs``, for the native kernel.
    """

    seqs: list[_SeqPlan]
    slot_mapping: torch.Tensor
    num_tokens: int
    decode: _DecodePlan | None = None


#: Longest chunk whose queries the native kernel takes: all of them. Every row of a chunk equals
#: decoding that token alone (prompts, forced runs, drafts), so prefill, chunked prefill at any
#: budget, prefix-cache hits and decoding give the same bits at any prompt length. Consecutive rows
#: of a sequence run as tiles that load each key and value once (kernels/attention_rows.h), which
#: keeps long prefills within a few percent of SDPA (benchmarks/bench_native_prefill.py). A smaller
#: limit sends longer chunks through SDPA, whose bits differ from the kernel's.
NATIVE_MAX_QUERY = sys.maxsize


class PagedAttention:
    """Attention backend: one plan per forward (:meth:`plan`), then one call per layer.

    This class runs every sequence through torch's SDPA, which takes any device and dtype.
    """

    #: Sequences with at most this many new tokens go to the native decode kernel (none here).
    max_native_query = 0

    def plan(
        self,
        meta: AttentionMetadata,
        num_tokens: int,
        num_slots: int,
        device: torch.device,
        sliding_window: int | None = None,
    ) -> AttentionPlan:
        """Validate ``meta`` against the batch and build the gather indices and masks every layer
        reuses (layers with a ``sliding_window`` get a plan of their own).

        Whether a sequence takes the native kernel depends only on that sequence, so batch
        invariance holds. With ``sliding_window``, query position ``p`` attends to keys
        ``p - sliding_window < k <= p`` (the cache keeps the older ones): a chunk through SDPA
        gets a band mask over the keys its queries can still see, a row of the native decode kernel
        a table of the window's slots.
        """
        limit = self.max_native_query
        native: list[_NativeRun] = []
        qsl = meta.query_start_loc
        batch = len(meta.context_lens)
        if len(qsl) != batch + 1 or len(meta.block_tables) != batch:
            raise EngineError(
                f"AttentionMetadata: {len(qsl)} query_start_loc entries, {batch} context_lens and "
                f"{len(meta.block_tables)} block tables do not describe the same batch"
            )
        if qsl[0] != 0 or qsl[-1] != num_tokens:
            raise EngineError(
                f"AttentionMetadata.query_start_loc spans [{qsl[0]}, {qsl[-1]}) but the batch has {num_tokens} tokens"
            )
        if meta.slot_mapping.numel() != num_tokens:
            raise EngineError(f"slot_mapping has {meta.slot_mapping.numel()} entries for {num_tokens} tokens")
        bs = meta.block_size
        seqs = []
        arange = torch.arange(bs, dtype=torch.int64)
        for i in range(batch):
            start, end, ctx = qsl[i], qsl[i + 1], meta.context_lens[i]
            q_len = end - start
            table = meta.block_tables[i]
            if q_len < 1 or ctx < q_len or len(table) * bs < ctx:
                raise EngineError(
                    f"sequence {i}: {q_len} new tokens, context_len {ctx}, {len(table)} blocks of {bs} are inconsistent"
                )
            blocks_used = table[: (ctx + bs - 1) // bs]
            # The last used slot of the last block is the highest one only when ids ascend; check
            # every used block (Python ints: cheaper than building the gather for decode rows).
            last_block = (ctx - 1) // bs
            if max(blocks_used[:last_block], default=-1) * bs + bs > num_slots or (
                blocks_used[last_block] * bs + (ctx - 1) % bs >= num_slots
            ):
                raise EngineError(
                    f"sequence {i}: block table references a block beyond the {num_slots // bs}-block cache"
                )
            gather: torch.Tensor | None = None
            if q_len > limit or sliding_window is not None:
                blocks = torch.tensor(blocks_used, dtype=torch.int64)
                gather = (blocks[:, None] * bs + arange[None, :]).reshape(-1)[:ctx]
            if q_len <= limit:
                # Query j of a chunk (a prompt, forced tokens, a draft) attends to the first
                # ctx - q_len + j + 1 positions: exactly what decoding that token alone computes, so
                # prefill, chunked prefill, prefix-cache hits, jump-forward and speculation leave
                # every row's logits bit-identical to plain decoding.
                native.append(_NativeRun(start, q_len, ctx, blocks_used, gather))
                continue
            assert gather is not None
            seqs.append(_sdpa_plan(start, end, ctx, gather, sliding_window, device))
        slots = meta.slot_mapping.to(device=device, dtype=torch.int64)
        decode = _native_plan(native, bs, sliding_window, num_tokens, num_slots) if native else None
        return AttentionPlan(seqs=seqs, slot_mapping=slots, num_tokens=num_tokens, decode=decode)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: AttentionPlan,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Write the new ``k``/``v`` rows into the cache, then attend per sequence.

        ``q`` is ``[R, H, D]`` and ``k``/``v`` are ``[R, Hkv, D]`` where ``R >= plan.num_tokens`` (rows past
        ``num_tokens`` are batch padding: not cached, output zero). ``k_cache``/``v_cache`` are the flat
        ``[num_slots, Hkv, D]`` views. Scores are scaled by ``scale`` (default ``D ** -0.5``). Returns ``[R, H*D]``.
        """
        n = plan.num_tokens
        rows, heads, dim = q.shape
        k_cache.index_copy_(0, plan.slot_mapping, k[:n])
        v_cache.index_copy_(0, plan.slot_mapping, v[:n])
        if plan.decode is not None:
            return _with_native_decode(q, k_cache, v_cache, plan, plan.decode, scale)
        outs = []
        for s in plan.seqs:
            outs.append(_sdpa(q, k_cache, v_cache, s, scale))
        if rows > n:
            outs.append(q.new_zeros(rows - n, heads * dim))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class NativePagedAttention(PagedAttention):
    """:class:`PagedAttention` with the rows of chunks up to ``max_native_query`` tokens (by
    default all) on the native kernel (float32 CPU caches); longer chunks go through SDPA."""

    def __init__(self, max_native_query: int = NATIVE_MAX_QUERY) -> None:
        self.max_native_query = max_native_query


@dataclass
class _NativeRun:
    """The ``q_len`` new rows from ``start`` of one sequence whose context ends at ``ctx``."""

    start: int
    q_len: int
    ctx: int
    blocks: list[int]
    gather: torch.Tensor | None  # KV slots of the whole context (window plans only)


def _native_plan(
    runs: list[_NativeRun], bs: int, window: int | None, num_tokens: int, num_slots: int
) -> _DecodePlan:
    """One kernel entry per row: row ``j`` of a run sees the first ``ctx - q_len + j + 1`` positions.

    A row whose window cuts its context gets a table of single slots (block size 1) listing the
    window's keys. The rows of a run stay consecutive, so the kernel tiles them; without a window
    they share their sequence's table (memory grows with rows plus blocks, not their product).
    """
    rows: list[int] = []
    ctxs: list[int] = []
    table_rows: torch.Tensor | None = None
    for r in runs:
        rows.extend(range(r.start, r.start + r.q_len))
        ctxs.extend(range(r.ctx - r.q_len + 1, r.ctx + 1))
    if window is not None and max(ctxs) > window:
        width = min(window, max(ctxs))
        parts = []
        for r in runs:
            assert r.gather is not None
            c = torch.arange(r.ctx - r.q_len + 1, r.ctx + 1)
            idx = (c - window).clamp(min=0)[:, None] + torch.arange(width)[None, :]
            parts.append(r.gather[idx.clamp(max=r.ctx - 1)])
        tables = torch.cat(parts)
        ctxs = [min(c, window) for c in ctxs]
        bs = 1
    else:  # one table per sequence, shared by the rows of its chunk
        width = max(len(r.blocks) for r in runs)
        tables = torch.tensor([r.blocks + [0] * (width - len(r.blocks)) for r in runs], dtype=torch.int64)
        if len(rows) > len(runs):  # (a decode step needs no index: row i uses table i)
            table_rows = torch.repeat_interleave(
                torch.arange(len(runs)), torch.tensor([r.q_len for r in runs])
            )
    rows_t = torch.tensor(rows, dtype=torch.int64)
    ctx_t = torch.tensor(ctxs, dtype=torch.int64)
    native = native_ops.decode_batch(rows_t, tables, ctx_t, bs, num_tokens, num_slots, table_rows)
    return _DecodePlan(rows_t, tables, ctx_t, bs, native, num_slots, table_rows, sum(ctxs))


def _sdpa_plan(
    start: int, end: int, ctx: int, gather: torch.Tensor, window: int | None, device: torch.device
) -> _SeqPlan:
    """The SDPA plan of rows ``[start, end)`` whose queries are the last ``end - start`` of ``ctx`` keys."""
    q_len = end - start
    if window is not None and ctx > window:
        # keys before the first query's window are seen by no query: leave them out of the gather
        first = max(0, ctx - q_len - window + 1)
        kpos = torch.arange(first, ctx)[None, :]
        qpos = torch.arange(ctx - q_len, ctx)[:, None]
        window_mask = (kpos <= qpos) & (kpos > qpos - window)
        return _SeqPlan(start, end, gather[first:].to(device), window_mask.to(device), False)
    mask = None
    if 1 < q_len < ctx:
        # bottom-right aligned causal mask: query j sits at position ctx - q_len + j
        qpos = torch.arange(ctx - q_len, ctx)[:, None]
        mask = (torch.arange(ctx)[None, :] <= qpos).to(device)
    return _SeqPlan(start, end, gather.to(device), mask, q_len == ctx and q_len > 1)


def _sdpa(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, s: _SeqPlan, scale: float | None = None
) -> torch.Tensor:
    heads, dim = q.shape[1], q.shape[2]
    qs = q[s.start : s.end].transpose(0, 1).unsqueeze(0)
    ks = k_cache.index_select(0, s.gather).transpose(0, 1).unsqueeze(0)
    vs = v_cache.index_select(0, s.gather).transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(
        qs, ks, vs, attn_mask=s.mask, is_causal=s.causal, enable_gqa=True, scale=scale
    )
    return o[0].transpose(0, 1).reshape(s.end - s.start, heads * dim)


def _with_native_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
    dec: _DecodePlan,
    scale: float | None = None,
) -> torch.Tensor:
    rows, heads, dim = q.shape
    softmax_scale = dim**-0.5 if scale is None else scale
    out = q.new_zeros(rows, heads * dim) if rows > plan.num_tokens else q.new_empty(rows, heads * dim)
    q = q.contiguous()
    threads = native_ops.get_num_threads()
    if (
        q.dtype is torch.float32
        and k_cache.dtype is torch.float32
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and k_cache.shape == v_cache.shape
        and k_cache.shape[0] == dec.num_slots
        and k_cache.shape[2] == dim
        and v_cache.dtype is torch.float32
    ):
        # Raw addresses into a batch checked once per forward (rows below num_tokens <= q's rows,
        # blocks inside num_slots); the shapes and dtypes it relies on are checked just above.
        dec.native.run(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
            heads, k_cache.shape[1], dim, softmax_scale, threads,
        )  # fmt: skip
    else:  # the checking entry point: anything unexpected gets its typed error
        native_ops.decode_attention(
            q,
            k_cache,
            v_cache,
            out,
            dec.rows,
            dec.tables if dec.table_rows is None else dec.tables[dec.table_rows],
            dec.context_lens,
            dec.block_size,
            softmax_scale,
            threads,
        )
    for s in plan.seqs:
        out[s.start : s.end] = _sdpa(q, k_cache, v_cache, s, scale)
    return out
