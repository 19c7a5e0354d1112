"""What every DeepSeek V4 layer of one forward shares: per sequence, its window and its compressed entries.

Built once per forward from the batch's
:class:`~agent_infer.model.layers.attention.AttentionMetadata`, so the layers only do tensor math: the window's slots and band
mask are the same for every layer, and the entry slots and readiness mask the same for every layer
of one compression rate.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from agent_infer.errors import EngineError
from agent_infer.model.layers import native_deepseek
from agent_infer.model.layers.attention import AttentionMetadata


@dataclass
class RateView:
    """One sequence's compressed entries at one rate: windows ``[first, count)`` close in this chunk."""

    first: int
    count: int
    #: Entry-pool slots of windows ``0 .. count - 1`` (the slot of each window's last token // stride).
    entry_slots: torch.Tensor
    #: Bool ``[L, count]``: entry ``w`` is complete by query ``t`` (``w < (t + 1) // rate``).
    ready: torch.Tensor


@dataclass
class SeqView:
    """One sequence's chunk: query rows ``[start, end)``, its context's slots and its window."""

    start: int
    end: int
    gather: torch.Tensor
    qpos: torch.Tensor
    window_slots: torch.Tensor
    #: Bool ``[L, len(window_slots)]``: key ``k`` is in query ``t``'s window ``(t - W, t]``.
    window_allowed: torch.Tensor
    rates: dict[int, RateView]


#: A decode row's compressed entries are padded to a multiple of this many, so decode rows whose
#: entry counts round alike attend as one batch while a row's shapes (hence its bits) depend on its
#: own sequence only, never on which other rows share the step.
ENTRY_BUCKET = 64


@dataclass
class DecodeGroup:
    """Decode rows that attend as one batch at one compression rate (same padded entry count)."""

    #: Query rows of the members (int64 ``[b]``) and their indices into :attr:`CompressedPlan.seqs`.
    rows: torch.Tensor
    seqs: list[int]
    #: Window slots ``[b, window]`` (oldest first; slot 0 where the context is shorter) and their mask.
    window_slots: torch.Tensor
    window_allowed: torch.Tensor
    #: Entry slots ``[b, E]`` padded with slot 0 and the mask of real entries; None when ``E`` is 0.
    entry_slots: torch.Tensor | None
    ready: torch.Tensor | None


@dataclass
class NativeDecode:
    """Every single-token sequence of a forward as batched tensors, for the native decode kernel
    (engine_native/src/kernels/attention_v4.cpp), which attends row by row whatever the padding."""

    #: Query rows (int64 ``[b]``) and context lengths after this step (the row's position + 1).
    rows: torch.Tensor
    ctx: torch.Tensor
    #: Block tables ``[b, max_blocks]`` (padded with block 0).
    tables: torch.Tensor
    block_size: int
    #: Per compression rate (0: sliding-only layers) the kernel's checked view of the rows.
    batches: dict[int, native_deepseek.V4DecodeBatch]
    #: :meth:`closing`'s results, per rate (every layer of a rate closes the same windows).
    closings: dict[int, Closing | None] = field(default_factory=dict)
    #: Per rate, the most keys the rows attend in all (window entries plus every complete entry):
    #: the size of a layer's attention call, for its thread count.
    keys: dict[int, int] = field(default_factory=dict)

    def slots(self, members: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token slots ``[m, L]`` of ``positions`` ``[m, L]`` of the decode rows ``members`` ``[m]``."""
        bs = self.block_size
        return self.tables.index_select(0, members).gather(1, positions // bs) * bs + positions % bs

    def closing(self, rate: int) -> Closing | None:
        """The rows that complete a window of ``rate`` tokens in this step (None: no row does)."""
        if rate not in self.closings:
            members = (self.ctx % rate == 0).nonzero().view(-1)
            found = None
            if int(members.numel()):
                ctx = self.ctx.index_select(0, members)
                span = 2 * rate - 1  # the most an overlapping compressor pools besides the row's own
                positions = (ctx[:, None] - 1 - span + torch.arange(span)[None, :]).clamp(min=0)
                found = Closing(
                    self.rows.index_select(0, members),
                    ctx // rate - 1,
                    positions,
                    self.slots(members, positions),
                )
            self.closings[rate] = found
        return self.closings[rate]


@dataclass
class Closing:
    """Decode rows whose token completes a window at one rate."""

    rows: torch.Tensor
    #: The completed window of each (int64 ``[m]``).
    windows: torch.Tensor
    #: The ``2 * rate - 1`` positions before each row's own, oldest first (clamped at 0 where
    #: a row has fewer; the kernel reads only the ones its compressor pools) and their token slots.
    positions: torch.Tensor
    token_slots: torch.Tensor
    #: Rotary tables at each window's position, per rotary (filled by the first layer using them).
    tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


@dataclass
class CompressedPlan:
    """The per-forward plan of every sequence (and the flat slots of the new tokens).

    Sequences with one new token (decode rows) attend in :attr:`decode` groups, per compression
    rate (0 for sliding-only layers), or through :attr:`native` when the plan was made for the
    native kernel (they then have no :class:`SeqView`); the others one by one through :attr:`seqs`.
    """

    seqs: list[SeqView]
    slot_mapping: torch.Tensor
    num_tokens: int
    block_size: int
    decode: dict[int, list[DecodeGroup]]
    #: Positions of the new tokens (int64 ``[num_tokens]``).
    positions: torch.Tensor
    #: Each new token's sequence's context length after this step (int64 ``[num_tokens]``).
    seq_ends: torch.Tensor
    native: NativeDecode | None = None


def plan_compressed(
    meta: AttentionMetadata,
    num_tokens: int,
    num_slots: int,
    device: torch.device,
    window: int,
    rates: Iterable[int],
    native: bool = False,
) -> CompressedPlan:
    """Validate ``meta`` against the batch (as :meth:`PagedAttention.plan` does, raising
    :class:`EngineError`) and build the views of every sequence for a sliding ``window`` and the
    compression ``rates``. No ``[chunk, context]`` mask is built: masks span the window and the
    compressed entries only. With ``native`` (CPU), single-token sequences go to
    :attr:`CompressedPlan.native` instead of views and groups."""
    qsl, bs = meta.query_start_loc, meta.block_size
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
    rates = tuple(rates)
    seqs = []
    single: list[int] = []
    for i in range(batch):
        start, end, ctx = qsl[i], qsl[i + 1], meta.context_lens[i]
        table = meta.block_tables[i]
        if end - start < 1 or ctx < end - start or len(table) * bs < ctx:
            raise EngineError(
                f"sequence {i}: {end - start} new tokens, context_len {ctx}, {len(table)} blocks of {bs} are inconsistent"
            )
        if native and end - start == 1:
            used = table[: (ctx + bs - 1) // bs]
            if max(used) >= num_slots // bs or min(used) < 0:
                raise EngineError(
                    f"sequence {i}: block table references a block outside the {num_slots // bs}-block cache"
                )
            single.append(i)
            continue
        blocks = torch.tensor(table[: (ctx + bs - 1) // bs], dtype=torch.int64)
        if int(blocks.max()) >= num_slots // bs or int(blocks.min()) < 0:
            raise EngineError(
                f"sequence {i}: block table references a block outside the {num_slots // bs}-block cache"
            )
        gather = (
            (blocks[:, None] * bs + torch.arange(bs, dtype=torch.int64)[None, :]).reshape(-1)[:ctx].to(device)
        )
        first = ctx - (end - start)
        qpos = torch.arange(first, ctx, device=device)
        lo = max(0, first - window + 1)
        kpos = torch.arange(lo, ctx, device=device)
        allowed = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)
        views = {}
        for rate in rates:
            count = ctx // rate
            slots = gather[rate - 1 : count * rate : rate] // min(rate, bs)
            ready = torch.arange(count, device=device)[None, :] < ((qpos + 1) // rate)[:, None]
            views[rate] = RateView(first // rate, count, slots, ready)
        seqs.append(SeqView(start, end, gather, qpos, gather[lo:ctx], allowed, views))
    slots = meta.slot_mapping.to(device=device, dtype=torch.int64)
    lengths = torch.tensor([qsl[i + 1] - qsl[i] for i in range(batch)], dtype=torch.int64)
    ends = torch.tensor(list(meta.context_lens), dtype=torch.int64)
    seq_ends = ends.repeat_interleave(lengths).to(device)
    positions = _positions(qsl, meta.context_lens, device)
    if native:
        nd = _native_decode(meta, single, num_tokens, num_slots, window, rates)
        return CompressedPlan(seqs, slots, num_tokens, bs, {}, positions, seq_ends, nd)
    decode = _decode_groups(seqs, window, rates, device)
    return CompressedPlan(seqs, slots, num_tokens, bs, decode, positions, seq_ends)


def _positions(qsl: list[int], context_lens: list[int], device: torch.device) -> torch.Tensor:
    """Each new token's position (int64): row ``j`` of sequence ``i`` is at ``ctx_i - len_i + j``."""
    out: list[int] = []
    for i, ctx in enumerate(context_lens):
        out.extend(range(ctx - (qsl[i + 1] - qsl[i]), ctx))
    return torch.tensor(out, dtype=torch.int64, device=device)


def _native_decode(
    meta: AttentionMetadata,
    single: list[int],
    num_tokens: int,
    num_slots: int,
    window: int,
    rates: tuple[int, ...],
) -> NativeDecode | None:
    """The single-token sequences ``single`` as :class:`NativeDecode` (None when there are none)."""
    if not single:
        return None
    bs = meta.block_size
    ctx_list = [meta.context_lens[i] for i in single]
    used = [meta.block_tables[i][: (c + bs - 1) // bs] for i, c in zip(single, ctx_list)]
    width = max(map(len, used))
    tables = torch.tensor([t + [0] * (width - len(t)) for t in used], dtype=torch.int64)
    ctx = torch.tensor(ctx_list, dtype=torch.int64)
    rows = torch.tensor([meta.query_start_loc[i] for i in single], dtype=torch.int64)
    # The kernel derives each row's window and entry slots from its table (checked there).
    batches = {
        rate: native_deepseek.v4_decode_batch(rows, tables, ctx, bs, window, rate, num_tokens, num_slots)
        for rate in (0, *rates)
    }
    keys = {rate: sum(min(c, window) + (c // rate if rate else 0) for c in ctx_list) for rate in (0, *rates)}
    return NativeDecode(rows, ctx, tables, bs, batches, keys=keys)


def _decode_groups(
    seqs: list[SeqView], window: int, rates: Iterable[int], device: torch.device
) -> dict[int, list[DecodeGroup]]:
    """Batch the one-row sequences: per rate, one group per padded entry count."""
    single = [i for i, s in enumerate(seqs) if s.end - s.start == 1]
    if not single:
        return {}
    slots = torch.zeros(len(single), window, dtype=torch.int64, device=device)
    allowed = torch.zeros(len(single), window, dtype=torch.bool, device=device)
    for j, i in enumerate(single):
        have = int(seqs[i].window_slots.shape[0])
        slots[j, window - have :] = seqs[i].window_slots
        allowed[j, window - have :] = True
    rows = torch.tensor([seqs[i].start for i in single], dtype=torch.int64, device=device)
    out = {0: [DecodeGroup(rows, single, slots, allowed, None, None)]}
    for rate in rates:
        buckets: dict[int, list[int]] = {}
        for j, i in enumerate(single):
            count = seqs[i].rates[rate].count
            buckets.setdefault(-(-count // ENTRY_BUCKET) * ENTRY_BUCKET, []).append(j)
        groups = []
        for width, members in sorted(buckets.items()):
            pick = torch.tensor(members, dtype=torch.int64, device=device)
            entry_slots = ready = None
            if width:
                entry_slots = torch.zeros(len(members), width, dtype=torch.int64, device=device)
                for k, j in enumerate(members):
                    view = seqs[single[j]].rates[rate]
                    entry_slots[k, : view.count] = view.entry_slots
                counts = torch.tensor([seqs[single[j]].rates[rate].count for j in members], device=device)
                ready = torch.arange(width, device=device)[None, :] < counts[:, None]
            groups.append(
                DecodeGroup(
                    rows[pick], [single[j] for j in members], slots[pick], allowed[pick], entry_slots, ready
                )
            )
        out[rate] = groups
    return out
