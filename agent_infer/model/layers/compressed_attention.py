"""DeepSeek V4 attention over the compressed paged layout: a sliding window plus compressed entries.

Every layer is multi-query attention with one shared head that is both key and value: a token's
entry is ``rope(norm(wkv x))`` (only its trailing ``qk_rope_head_dim`` dims rotate). A query at
position ``t`` sees the raw entries of positions ``(t - sliding_window, t]`` and, on compressed
layers, the compressed entries whose window is complete by ``t`` (:mod:`.compressor`); on sparse
layers only the ``index_topk`` of those the lightning indexer (:mod:`.indexer`) picks. Each head
has a learned sink logit that joins the softmax's denominator and attends to nothing. The output's
trailing dims are rotated back by the query's angle (values carry their keys' rotation), then a
grouped projection (``wo_a``: each of ``o_groups`` head groups to ``o_lora_rank``) and ``wo_b``.

Queries are ``rms(wq_b(q_norm(wq_a x)))`` per head (an unweighted RMS norm). All projections of
the layer's input (``wq_a``, ``wkv``, the compressors' value/gate projections, the indexer's head
weights) run as one fused matmul; the compressors' per-token projections go to the state pool,
so a window closed in a later step (or by another sequence sharing the prefix) finds them there.

Each sequence attends on its own with the same shapes alone or in a batch (batch invariance, as in
layers/attention.py). On the packed-float kernels the single-token sequences run natively instead
(:mod:`.compressed_native`), and so do RoPE with its norms and the grouped projection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from agent_infer.errors import EngineError
from agent_infer.model.config import ModelConfig
from agent_infer.model.layers import compressed_native, native_deepseek, native_ops
from agent_infer.model.layers.compressed_plan import CompressedPlan, DecodeGroup, RateView, SeqView
from agent_infer.model.layers.compressor import WindowCompressor
from agent_infer.model.layers.indexer import LightningIndexer
from agent_infer.model.layers.interleaved_rotary import InterleavedRotary
from agent_infer.model.layers.linear import Linear, LinearBuilder, WeightPart, in_row_chunks
from agent_infer.model.layers.norm import RMSNorm

#: Queries of one chunk attend in pieces of at most this many rows, so a long prompt's scores
#: (``heads x rows x (window + entries)``) and indexer scores stay bounded.
QUERY_BLOCK = 256


@dataclass
class CompressorPools:
    """A compressed layer's pools (``"compressed"`` layout of :class:`~agent_infer.model.kv_cache.KVCache`)."""

    #: Compressor states ``[num_blocks * ring, state]``: a block's last ``ring`` tokens, offset ``o`` at ``o % ring``.
    states: torch.Tensor
    #: Compressed entries ``[num_entry_slots, entry]``.
    entries: torch.Tensor
    ring: int
    #: Position held by each state slot (int32, ``[num_blocks * ring]``), None where ``ring`` is the block.
    positions: torch.Tensor | None

    def state_slots(self, slots: torch.Tensor, block_size: int) -> torch.Tensor:
        """State-pool slots of the tokens at token slots ``slots``."""
        if self.ring == block_size:
            return slots
        return slots // block_size * self.ring + slots % block_size % self.ring


class CompressedAttention(nn.Module):
    """Layer ``index``'s attention (HF names under ``model.layers.{index}.attn.``)."""

    def __init__(
        self,
        config: ModelConfig,
        index: int,
        rotary: InterleavedRotary,
        linears: LinearBuilder,
        device: torch.device | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        spec = config.deepseek_v4
        if spec is None:
            raise ValueError("CompressedAttention needs a DeepSeek V4 config")
        p = f"model.layers.{index}.attn."
        self.heads, self.dim = config.num_heads, config.head_dim
        self.q_lora = spec.q_lora_rank
        self.window = spec.sliding_window
        self.eps = config.rms_norm_eps
        self.rotary = rotary
        self.rate = spec.compress_rates[index]
        self.groups, self.o_lora = spec.o_groups, spec.o_lora_rank
        self.compressor: WindowCompressor | None = None
        self.indexer: LightningIndexer | None = None
        parts = [WeightPart(p + "wq_a.weight", self.q_lora), WeightPart(p + "wkv.weight", self.dim)]
        if self.rate:
            sparse = spec.sparse[index]
            self.compressor = WindowCompressor(self.rate, self.dim, sparse, self.eps, device, dtype)
            width = self.compressor.series * self.dim
            parts += [
                WeightPart(p + "compressor.wkv.weight", width),
                WeightPart(p + "compressor.wgate.weight", width),
            ]
            if sparse:
                self.indexer = LightningIndexer(
                    p + "indexer.", linears, self.rate, spec.index_n_heads, spec.index_head_dim,
                    spec.index_topk, self.q_lora, self.eps, device, dtype,
                )  # fmt: skip
                iw = 2 * spec.index_head_dim
                parts += [
                    WeightPart(p + "indexer.compressor.wkv.weight", iw),
                    WeightPart(p + "indexer.compressor.wgate.weight", iw),
                    WeightPart(p + "indexer.weights_proj.weight", spec.index_n_heads),
                ]
        self.prefix = p
        self.down: Linear = linears.linear(parts, config.hidden_size)
        self.q_norm = RMSNorm(self.q_lora, self.eps, device, dtype)
        self.q_up: Linear = linears.linear(
            [WeightPart(p + "wq_b.weight", self.heads * self.dim)], self.q_lora
        )
        self.kv_norm = RMSNorm(self.dim, self.eps, device, dtype)
        group_in = self.heads * self.dim // self.groups
        self.wo_a = nn.Parameter(
            torch.empty(self.groups * self.o_lora, group_in, device=device, dtype=dtype), requires_grad=False
        )
        self.wo_b: Linear = linears.linear(
            [WeightPart(p + "wo_b.weight", config.hidden_size)], self.groups * self.o_lora
        )
        self.sinks = nn.Parameter(
            torch.empty(self.heads, device=device, dtype=torch.float32), requires_grad=False
        )
        self.scale = self.dim**-0.5
        #: ``wo_a``'s groups on the native kernel once :meth:`pack_native` ran (float32 CPU models).
        self.wo_a_packed: list[native_ops.PackedWeight] | None = None

    def pack_native(self, pack: Callable[[torch.Tensor], native_ops.PackedWeight]) -> None:
        """Run the grouped output projection on the native kernel (one row-independent call per
        group) over ``pack`` of each group's ``wo_a`` rows from now on."""
        self.wo_a_packed = [pack(w) for w in self.wo_a.view(self.groups, self.o_lora, -1)]

    def load_targets(self) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]:
        """HF names of every tensor of the layer."""
        p = self.prefix
        t = self.down.load_targets()
        t.update(self.q_up.load_targets())
        t.update(self.wo_b.load_targets())
        for name, tensor in (
            ("q_norm.weight", self.q_norm.weight),
            ("norm.weight", self.kv_norm.weight),
            ("wo_a.weight", self.wo_a),
            ("attn_sink", self.sinks),
        ):
            t[p + name] = (tensor, 0, tuple(tensor.shape))
        comps: list[tuple[str, WindowCompressor]] = []
        if self.compressor is not None:
            comps.append(("compressor.", self.compressor))
        if self.indexer is not None:
            t.update(self.indexer.q_up.load_targets())
            comps.append(("indexer.compressor.", self.indexer.compressor))
        for q, c in comps:
            t[p + q + "ape"] = (c.ape, 0, tuple(c.ape.shape))
            t[p + q + "norm.weight"] = (c.norm, 0, tuple(c.norm.shape))
        return t

    def forward(
        self,
        x: torch.Tensor,
        norm: RMSNorm,
        tables: tuple[torch.Tensor, torch.Tensor],
        window: torch.Tensor,
        compressed: CompressorPools | None,
        plan: CompressedPlan,
    ) -> torch.Tensor:
        """Output ``[R, hidden]`` for ``norm(x)`` (``x`` ``[R, hidden]``; rotated by ``tables``, this
        layer's rotary at the rows' positions); writes the new tokens' window entries, compressor
        states and completed windows' entries into the pools (``window`` ``[num_slots, head_dim]``,
        ``compressed`` the state and entry pools)."""
        rows, n = int(x.shape[0]), plan.num_tokens
        ql, d = self.q_lora, self.dim
        h = self.down.project_normed(x, norm)
        # q_b and the indexer's wq_b share the normed query latent: each packed call normalizes the
        # slice itself, which costs less than a separate torch norm (the torch path runs one).
        q_lat = h[:, :ql]
        q = self.rotary.norm_apply(
            self.q_up.project_normed(q_lat, self.q_norm).view(rows, self.heads, d), tables, None, self.eps
        )
        kv = self.rotary.norm_apply(h[:, ql : ql + d], tables, self.kv_norm.weight, self.kv_norm.eps)
        window.index_copy_(0, plan.slot_mapping, kv[:n])
        iq = iw = None
        fresh = h[:0]
        if compressed is not None and self.compressor is not None:
            width = self.compressor.state_width
            if self.indexer is not None:
                width += self.indexer.compressor.state_width
                ix = self.indexer
                iq = self.rotary.apply(
                    ix.q_up.project_normed(q_lat, self.q_norm).view(rows, ix.heads, ix.dim), tables
                )
                iw = h[:, ql + d + width : ql + d + width + ix.heads]
            fresh = h[:n, ql + d : ql + d + width]
        compressing = compressed is not None and self.compressor is not None
        groups = plan.decode.get(self.rate if compressing else 0, [])
        batched = {i for g in groups for i in g.seqs} if groups else set()
        out = q.new_zeros(rows, self.heads, d)
        if compressing and compressed is not None and groups:
            self._close_decode(
                compressed, fresh, [plan.seqs[i] for g in groups for i in g.seqs], plan.block_size
            )
        nd = plan.native
        if nd is not None:
            if compressing and compressed is not None:
                compressed_native.close_windows(self, compressed, fresh, nd, plan.slot_mapping)
            index = (iq, iw) if iq is not None and iw is not None else None
            pool = compressed.entries if compressing and compressed is not None else None
            rate = self.rate if compressing else 0
            compressed_native.attend(
                self, nd.batches[rate], q, window, pool, index, out, nd.keys.get(rate, 0)
            )
        for i, s in enumerate(plan.seqs):
            if i in batched:
                continue
            idx = (iq[s.start : s.end], iw[s.start : s.end]) if iq is not None and iw is not None else None
            entries = None
            if compressing and compressed is not None:
                entries = self._entries(compressed, fresh[s.start : s.end], s, plan.block_size)
            out[s.start : s.end] = self._attend(q[s.start : s.end], window, entries, idx, s)
        for g in groups:
            index = (iq, iw) if iq is not None and iw is not None else None
            pool = compressed.entries if compressing and compressed is not None else None
            out.index_copy_(0, g.rows, self._attend_decode(q, window, pool, index, g))
        if compressing and compressed is not None:
            # Written after every read of this step: a ring slot may still hold a state read above.
            slots, states = plan.slot_mapping, fresh
            if compressed.positions is not None:
                # A chunk longer than the ring wraps it: keep only each slot's last token, so no
                # slot is written twice (index_copy_ leaves duplicates in an undefined order).
                pos, bs, ring = plan.positions, plan.block_size, compressed.ring
                kept = ((pos + ring >= plan.seq_ends) | (pos % bs + ring >= bs)).nonzero().view(-1)
                slots, states = slots[kept], fresh.index_select(0, kept)
                ring_slots = compressed.state_slots(slots, bs)
                compressed.positions.index_copy_(0, ring_slots, pos[kept].to(torch.int32))
            compressed.states.index_copy_(0, compressed.state_slots(slots, plan.block_size), states)
        out = self.rotary.apply(out, tables, inverse=True)
        if self.wo_a_packed is not None:
            return self.wo_b.project(native_deepseek.grouped_linear(self.wo_a_packed, out.view(rows, -1)))
        out = out.reshape(rows, self.groups, -1)
        w = self.wo_a.view(self.groups, self.o_lora, -1).transpose(1, 2)
        grouped = in_row_chunks(
            lambda o: torch.bmm(o.transpose(0, 1), w).transpose(0, 1).reshape(int(o.shape[0]), -1), out
        )
        return self.wo_b.project(grouped)

    def _attend(
        self,
        q: torch.Tensor,
        window: torch.Tensor,
        entries: torch.Tensor | None,
        index: tuple[torch.Tensor, torch.Tensor] | None,
        s: SeqView,
    ) -> torch.Tensor:
        length = s.end - s.start
        if length <= QUERY_BLOCK:
            return self._attend_rows(q, window, entries, index, s, 0, length)
        outs = []
        for a in range(0, length, QUERY_BLOCK):
            b = min(a + QUERY_BLOCK, length)
            piece = None if index is None else (index[0][a:b], index[1][a:b])
            outs.append(self._attend_rows(q[a:b], window, entries, piece, s, a, b))
        return torch.cat(outs)

    def _attend_rows(
        self,
        q: torch.Tensor,
        window: torch.Tensor,
        entries: torch.Tensor | None,
        index: tuple[torch.Tensor, torch.Tensor] | None,
        s: SeqView,
        a: int,
        b: int,
    ) -> torch.Tensor:
        """Queries ``a .. b - 1`` of the chunk: their window keys, then the entries complete by the last."""
        ctx = int(s.gather.shape[0])
        first = ctx - (s.end - s.start)
        lo = ctx - int(s.window_slots.shape[0])
        k_lo, k_hi = max(lo, first + a - self.window + 1) - lo, first + b - lo
        keys = window.index_select(0, s.window_slots[k_lo:k_hi])
        allowed = s.window_allowed[a:b, k_lo:k_hi]
        count = (first + b) // self.rate if self.rate else 0
        if entries is not None and count:
            visible = s.rates[self.rate].ready[a:b, :count]
            if self.indexer is not None and index is not None:
                visible = self.indexer.select(index[0], index[1], entries[:count, self.dim :], visible)
            keys = torch.cat((keys, entries[:count, : self.dim]))
            allowed = torch.cat((allowed, visible), dim=1)
        logits = torch.matmul(q.transpose(0, 1), keys.t()) * self.scale  # [heads, rows, keys]
        logits = logits.masked_fill(~allowed[None], float("-inf"))
        sinks = self.sinks.to(logits.dtype)[:, None, None].expand(-1, b - a, 1)
        combined = torch.cat((logits, sinks), dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = combined.softmax(dim=-1)[..., :-1].to(keys.dtype)
        return torch.matmul(probs, keys).transpose(0, 1)

    def _attend_decode(
        self,
        q: torch.Tensor,
        window: torch.Tensor,
        pool: torch.Tensor | None,
        index: tuple[torch.Tensor, torch.Tensor] | None,
        g: DecodeGroup,
    ) -> torch.Tensor:
        """One query per member, attending as one batch (``[b, heads, head_dim]``): padded window
        slots and entries are masked out, and every member has the group's shapes, which depend on
        its own sequence only (see :data:`~.compressed_plan.ENTRY_BUCKET`)."""
        b = int(g.rows.shape[0])
        qg = q.index_select(0, g.rows)
        keys = window.index_select(0, g.window_slots.view(-1)).view(b, -1, self.dim)
        allowed = g.window_allowed
        if pool is not None and g.entry_slots is not None and g.ready is not None:
            entries = pool.index_select(0, g.entry_slots.view(-1)).view(b, -1, int(pool.shape[-1]))
            visible = g.ready
            if self.indexer is not None and index is not None:
                iq, iw = index[0].index_select(0, g.rows), index[1].index_select(0, g.rows)
                visible = self.indexer.select(iq, iw, entries[..., self.dim :], visible)
            keys = torch.cat((keys, entries[..., : self.dim]), dim=1)
            allowed = torch.cat((allowed, visible), dim=1)
        logits = torch.matmul(qg, keys.transpose(1, 2)) * self.scale  # [b, heads, keys]
        logits = logits.masked_fill(~allowed[:, None], float("-inf"))
        sinks = self.sinks.to(logits.dtype)[None, :, None].expand(b, -1, 1)
        combined = torch.cat((logits, sinks), dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = combined.softmax(dim=-1)[..., :-1].to(keys.dtype)
        return torch.matmul(probs, keys)

    def _entries(
        self, compressed: CompressorPools, fresh: torch.Tensor, s: SeqView, block_size: int
    ) -> torch.Tensor | None:
        """Close the windows this chunk completes; every entry so far (None before the first)."""
        view = self._close(compressed, fresh, s, block_size)
        if not view.count:
            return None
        return compressed.entries.index_select(0, view.entry_slots)

    def _close_decode(
        self, compressed: CompressorPools, fresh: torch.Tensor, seqs: list[SeqView], block_size: int
    ) -> None:
        """Write the entry of every window a decode row completes (one per such row), pooled for all
        rows at once (rows with and without a preceding window apart)."""
        assert self.compressor is not None
        rate = self.rate
        closing: dict[int, list[SeqView]] = {}
        for s in seqs:
            view = s.rates[rate]
            if view.count > view.first:
                closing.setdefault(1 if self.compressor.overlap and view.first > 0 else 0, []).append(s)
        for lead, members in closing.items():
            ctx = torch.tensor([int(s.gather.shape[0]) for s in members], device=fresh.device)
            span = (1 + lead) * rate - 1  # earlier tokens pooled with each row's own
            slots = compressed.state_slots(
                torch.stack([s.gather[-1 - span : -1] for s in members]), block_size
            )
            if compressed.positions is not None:
                want = ctx[:, None] - 1 - span + torch.arange(span, device=ctx.device)[None, :]
                if not bool(
                    (compressed.positions.index_select(0, slots.view(-1)).view_as(want) == want).all()
                ):
                    raise EngineError(
                        f"{self.prefix}: compressor states of a decode row's windows were overwritten: a draft "
                        f"rolled back deeper than the {compressed.ring}-token state ring allows (KVCache.allocate rollback)"
                    )
            earlier = compressed.states.index_select(0, slots.view(-1)).view(len(members), span, -1)
            own = fresh.index_select(0, torch.tensor([s.start for s in members], device=fresh.device))
            st = torch.cat((earlier, own[:, None]), dim=1)
            windows = ctx // rate - 1
            cw = self.compressor.state_width
            new = self.compressor.pool_each(st[..., :cw], windows, lead, self.rotary)
            if self.indexer is not None:
                ic = self.indexer.compressor
                new = torch.cat(
                    (new, ic.pool_each(st[..., cw : cw + ic.state_width], windows, lead, self.rotary)), 1
                )
            targets = torch.stack([s.rates[rate].entry_slots[-1] for s in members])
            compressed.entries.index_copy_(0, targets, new.to(compressed.entries.dtype))

    def _close(
        self, compressed: CompressorPools, fresh: torch.Tensor, s: SeqView, block_size: int
    ) -> RateView:
        """Write the entries of the windows this chunk completes; the sequence's view at this rate.
        ``fresh`` holds the chunk's own states (not yet in the pool); earlier tokens' come from it."""
        assert self.compressor is not None
        rate = self.rate
        view = s.rates[rate]
        first, count = view.first, view.count
        if count > first:
            lead = 1 if self.compressor.overlap and first > 0 else 0
            lo, chunk_first = (first - lead) * rate, int(s.gather.shape[0]) - (s.end - s.start)
            st = fresh[: count * rate - chunk_first]
            if lo < chunk_first:
                slots = compressed.state_slots(s.gather[lo:chunk_first], block_size)
                if compressed.positions is not None:
                    held = compressed.positions.index_select(0, slots)
                    if not bool((held == torch.arange(lo, chunk_first, device=held.device)).all()):
                        raise EngineError(
                            f"{self.prefix}: compressor states of positions {lo}..{chunk_first - 1} were overwritten: "
                            f"a draft rolled back deeper than the {compressed.ring}-token state ring allows "
                            "(KVCache.allocate rollback)"
                        )
                st = torch.cat((compressed.states.index_select(0, slots), st))
            cw = self.compressor.state_width
            new = self.compressor.pool(st[:, :cw], first, count - first, self.rotary)
            if self.indexer is not None:
                ic = self.indexer.compressor
                new = torch.cat(
                    (new, ic.pool(st[:, cw : cw + ic.state_width], first, count - first, self.rotary)), 1
                )
            pool = compressed.entries
            pool.index_copy_(0, view.entry_slots[first:], new.to(pool.dtype))
        return view
