"""Expert parallelism: a MoE layer's routed experts spread over ranks, tokens moved all-to-all.

Every rank keeps the router, the correction bias and the shared experts (they run on its own
tokens), and ``S`` expert slots per MoE layer, filled by the EPLB placement (``eplb.py``). A step
of one layer on one rank:

1. route the rank's tokens (the replicated router); each (token, expert) pair picks one replica of
   its expert (``token % replicas``, so replicas share the traffic) and thus a destination rank;
2. exchange per-destination counts of token rows and pairs (``all_to_all_single`` of ``2R``
   integers), then each pair's (row, slot) ids and the token rows, a token's row going once to each
   rank that hosts any of its experts (deduplicated per rank, as DeepEP does);
3. run each local slot's SwiGLU over the rows of its pairs;
4. send one output row per pair back (the reverse all-to-all) and sum each token's expert outputs
   in ascending logical-expert order, as the single-process layer does. Combining on the expert's
   rank instead would halve the return traffic but change the order of the float additions.

The expert matmuls are row-invariant (fixed row chunks, ``layers/linear.py``) and the sum order per
token is the single-process one, so a token's output is bit-identical to one process whatever rank
and batch it ran in. A rank with no tokens still joins every exchange (an idle step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from agent_infer.errors import ConfigError, EngineError
from agent_infer.model.layers.moe import MoE, expert_mlp
from agent_infer.parallel.eplb import Placement
from agent_infer.parallel.expert_loading import ExpertSlots
from agent_infer.parallel.load_stats import ExpertLoad


@dataclass
class TrafficStats:
    """All-to-all bytes this rank sent (tokens out and results back), rebalance bytes, and where
    the layer's time went: ``wait_seconds`` in the count exchange (mostly waiting for slower
    ranks: the step is in lock-step), ``transfer_seconds`` in the row exchanges,
    ``expert_seconds`` in the local experts' matmuls."""

    dispatch_bytes: int = 0
    wait_seconds: float = 0.0
    transfer_seconds: float = 0.0
    expert_seconds: float = 0.0
    rebalance_bytes: int = 0
    idle_layers: int = 0
    per_rank_pairs: list[int] = field(default_factory=list)


class _LayerExperts:
    """One MoE layer's slots on this rank and its dispatch/combine (the layer's ``expert_backend``)."""

    def __init__(
        self, owner: ExpertParallel, index: int, moe: MoE, placement: Placement, slots: ExpertSlots | None
    ) -> None:
        self.owner = owner
        self.index = index
        self.placement = placement
        #: DeepSeek V4's ``swiglu_limit``: the slots clamp as the single-process layer does.
        self.limit = moe.swiglu_limit
        self._tables()
        mine = placement.rank_slots(owner.rank)
        if slots is None:
            slots = ExpertSlots.cut(moe, mine)
        elif slots.experts != mine:
            raise ConfigError(
                f"MoE layer {index}: the loaded slots hold {slots.experts}, the placement {mine}"
            )
        self.gate_up, self.down = slots.gate_up, slots.down
        # The model's [E, ...] tensors (loaded or meta) are no longer used.
        empty = torch.empty(0, device=owner.device, dtype=slots.gate_up.dtype)
        moe.gate_up = nn.Parameter(empty, requires_grad=False)
        moe.down = nn.Parameter(empty.clone(), requires_grad=False)

    def _tables(self) -> None:
        physical = self.placement.physical_of()
        width = max(len(p) for p in physical)
        table = torch.full((len(physical), width), -1, dtype=torch.int64)
        for e, slots in enumerate(physical):
            table[e, : len(slots)] = torch.tensor(slots)
        self.phys_table = table
        self.replica_count = torch.tensor([len(p) for p in physical], dtype=torch.int64)

    def forward(self, moe: MoE, x: torch.Tensor, hash_experts: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for this rank's ``x`` ``[T, H]`` (T may be 0); ``hash_experts``
        ``[T, top_k]`` fixes the tokens' experts (a hash-routed layer)."""
        owner = self.owner
        if owner.broken is not None:
            # A failed exchange leaves the ranks out of step; none may follow it.
            raise EngineError(f"the expert-parallel exchange failed earlier: {owner.broken}")
        try:
            return self._forward(moe, x, hash_experts)
        except RuntimeError as exc:
            owner.broken = f"{type(exc).__name__}: {exc}"
            raise

    def _forward(self, moe: MoE, x: torch.Tensor, hash_experts: torch.Tensor | None) -> torch.Tensor:
        owner = self.owner
        tokens = int(x.shape[0])
        k = moe.top_k
        if tokens:
            # A hash-routed layer's table only replaces the top-k choice: dispatch is the same.
            experts, weights = moe.route(x, hash_experts)
            owner.load.record(self.index, experts)
            flat = experts.reshape(-1).cpu()
            token_of = torch.arange(tokens).repeat_interleave(k)
            phys = self.phys_table[flat, token_of % self.replica_count[flat]]
        else:
            experts = torch.empty(0, k, dtype=torch.int64)
            weights = torch.empty(0, k)
            flat = token_of = phys = torch.empty(0, dtype=torch.int64)
        s, ranks = self.placement.slots_per_rank, owner.world_size
        dest = phys // s
        order = phys.argsort(stable=True)  # by destination rank, then slot, tokens ascending
        # A token goes once to each rank hosting any of its experts; each pair names its row there.
        width = max(tokens, 1)
        uniq, inverse = torch.unique(dest * width + token_of, sorted=True, return_inverse=True)
        rows_out = torch.bincount(uniq // width, minlength=ranks)
        pairs_out = torch.bincount(dest, minlength=ranks)
        row_start = torch.cumsum(rows_out, 0) - rows_out
        meta = torch.stack((inverse[order] - row_start[dest[order]], phys[order] % s), dim=1)
        # Collectives take tensors on the backend's device (NCCL/HCCL: the accelerator).
        comm = owner.device
        send_counts = torch.stack((rows_out, pairs_out), dim=1).reshape(-1).to(comm)
        recv_counts = torch.empty_like(send_counts)
        stats = owner.stats
        t0 = time.perf_counter()
        dist.all_to_all_single(recv_counts, send_counts, group=owner.group)
        t1 = time.perf_counter()
        recv = recv_counts.view(ranks, 2).cpu()
        rows_in, pairs_in = recv[:, 0], recv[:, 1]
        device = x.device
        send_rows = x.index_select(0, (uniq % width).to(device)).contiguous()
        recv_rows = x.new_empty(int(rows_in.sum()), int(x.shape[1]))
        recv_meta = torch.empty(int(pairs_in.sum()), 2, dtype=torch.int64, device=comm)
        pairs_out_l, pairs_in_l = pairs_out.tolist(), pairs_in.tolist()
        dist.all_to_all_single(
            recv_meta, meta.to(comm).contiguous(), pairs_in_l, pairs_out_l, group=owner.group
        )
        dist.all_to_all_single(recv_rows, send_rows, rows_in.tolist(), rows_out.tolist(), group=owner.group)
        t2 = time.perf_counter()
        recv_meta = recv_meta.cpu()
        source = torch.repeat_interleave(torch.arange(ranks), pairs_in)
        row_idx = recv_meta[:, 0] + (torch.cumsum(rows_in, 0) - rows_in)[source]
        results = self._run_slots(recv_rows, row_idx, recv_meta[:, 1])
        t3 = time.perf_counter()
        back = x.new_empty(len(order), int(x.shape[1]))
        dist.all_to_all_single(back, results, pairs_out_l, pairs_in_l, group=owner.group)
        t4 = time.perf_counter()
        stats.wait_seconds += t1 - t0
        stats.transfer_seconds += (t2 - t1) + (t4 - t3)
        stats.expert_seconds += t3 - t2
        # Bytes leaving this rank (what stays here is a copy, not traffic): token rows out, one
        # output row per pair back, each pair's (row, slot) ids, the counts.
        me = owner.rank
        row_bytes = int(x.shape[1]) * x.element_size()
        remote_rows = int(rows_out.sum()) - int(rows_out[me])
        remote_pairs = len(order) - pairs_out_l[me]
        stats.dispatch_bytes += remote_rows * row_bytes + remote_pairs * (row_bytes + 16) + 16 * (ranks - 1)
        stats.per_rank_pairs[self.index] += sum(pairs_in_l)
        if not tokens:
            stats.idle_layers += 1
            return x.new_empty(0, int(x.shape[1]))
        pair_out = torch.empty_like(back)
        pair_out[order.to(device)] = back
        return self._combine(moe, x, flat, weights, pair_out)

    def _run_slots(self, rows: torch.Tensor, row_idx: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """One output row per received pair: its slot's SwiGLU of its token row."""
        out = rows.new_empty(int(slots.shape[0]), int(rows.shape[1]))
        if not int(slots.shape[0]):
            return out
        order = slots.argsort(stable=True)
        counts = torch.bincount(slots, minlength=self.placement.slots_per_rank).tolist()
        start = 0
        for slot, count in enumerate(counts):
            if count:
                idx = order[start : start + count]
                picked = rows.index_select(0, row_idx[idx].to(rows.device))
                out[idx.to(rows.device)] = expert_mlp(picked, self.gate_up[slot], self.down[slot], self.limit)
            start += count
        return out

    def _combine(
        self, moe: MoE, x: torch.Tensor, flat: torch.Tensor, weights: torch.Tensor, pair_out: torch.Tensor
    ) -> torch.Tensor:
        """Weighted sum of each token's expert outputs in ascending expert order, plus shared experts:
        the single-process layer's arithmetic, operation for operation."""
        device = x.device
        order = flat.argsort(stable=True).to(device)
        counts = torch.bincount(flat, minlength=moe.num_experts).tolist()
        token_of = order // moe.top_k
        pair_weights = weights.reshape(-1)[order]
        out = torch.zeros(x.shape, dtype=torch.float32, device=device)
        start = 0
        for count in counts:
            if count:
                seg = order[start : start + count]
                out.index_add_(
                    0,
                    token_of[start : start + count],
                    pair_out[seg].float() * pair_weights[start : start + count, None],
                )
            start += count
        if moe.shared_gate_up is not None and moe.shared_down is not None:
            out += expert_mlp(x, moe.shared_gate_up, moe.shared_down, moe.swiglu_limit).float()
        return out.to(x.dtype)

    def move_to(self, new: Placement) -> int:
        """Refill this rank's slots for placement ``new`` (weights copied locally where this rank
        already holds the expert, else received from the lowest rank holding it, or read from the
        checkpoint when the owner has a ``fetch``); the bytes sent."""
        if self.owner.fetch is not None:
            self._refill_from_files(new)
            return 0
        old, owner = self.placement, self.owner
        r, s = owner.world_size, old.slots_per_rank
        holders = [[rank for rank in range(r) if e in old.rank_slots(rank)] for e in range(old.num_experts)]

        def source(rank: int, e: int) -> int:
            return rank if rank in holders[e] else holders[e][0]

        per_item = self.gate_up[0].numel() + self.down[0].numel()
        outgoing: list[list[int]] = [[] for _ in range(r)]  # old local slot indices, per destination
        incoming: list[list[int]] = [[] for _ in range(r)]  # new local slot indices, per source
        for dest in range(r):
            for j, e in enumerate(new.rank_slots(dest)):
                src = source(dest, e)
                if src == dest:
                    continue
                if src == owner.rank:
                    outgoing[dest].append(old.rank_slots(src).index(e))
                if dest == owner.rank:
                    incoming[src].append(j)
        flat_w = torch.cat((self.gate_up.reshape(s, -1), self.down.reshape(s, -1)), dim=1)
        send = flat_w[[i for items in outgoing for i in items]].contiguous()
        recv = flat_w.new_empty(sum(len(i) for i in incoming), per_item)
        dist.all_to_all_single(
            recv, send, [len(i) for i in incoming], [len(i) for i in outgoing], group=owner.group
        )
        new_w = flat_w.new_empty(s, per_item)
        mine = old.rank_slots(owner.rank)
        for j, e in enumerate(new.rank_slots(owner.rank)):
            if source(owner.rank, e) == owner.rank:
                new_w[j] = flat_w[mine.index(e)]
        received = [j for items in incoming for j in items]
        if received:
            new_w[received] = recv
        split = self.gate_up[0].numel()
        self.gate_up = new_w[:, :split].reshape(self.gate_up.shape).contiguous()
        self.down = new_w[:, split:].reshape(self.down.shape).contiguous()
        self.placement = new
        self._tables()
        return int(send.numel()) * send.element_size()

    def _refill_from_files(self, new: Placement) -> None:
        """Slots for ``new`` without any exchange: experts this rank holds are copied, the others
        read from the checkpoint (no collective, so ranks need not agree on who sends)."""
        fetch = self.owner.fetch
        assert fetch is not None
        mine = self.placement.rank_slots(self.owner.rank)
        gate_up, down = torch.empty_like(self.gate_up), torch.empty_like(self.down)
        for j, e in enumerate(new.rank_slots(self.owner.rank)):
            if e in mine:
                gate_up[j], down[j] = self.gate_up[mine.index(e)], self.down[mine.index(e)]
            else:
                gate_up[j], down[j] = fetch(self.index, e)
        self.gate_up, self.down = gate_up, down
        self.placement = new
        self._tables()


class ExpertParallel:
    """The MoE layers of one rank's model under expert parallelism (installs their backends).

    ``placements`` gives each MoE layer's starting placement (the same on every rank); the model's
    full expert tensors are replaced by this rank's slots.
    """

    def __init__(
        self,
        moes: Sequence[MoE],
        placements: Sequence[Placement],
        *,
        rank: int,
        world_size: int,
        window: int = 1000,
        group: dist.ProcessGroup | None = None,
        slots: Sequence[ExpertSlots] | None = None,
        fetch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> None:
        if not moes:
            raise ConfigError("expert parallelism needs a model with MoE layers")
        if len(placements) != len(moes):
            raise ConfigError(f"{len(placements)} placements for {len(moes)} MoE layers")
        for p in placements:
            if p.num_ranks != world_size or p.num_experts != moes[0].num_experts:
                raise ConfigError("a placement does not match the ranks or the experts of the model")
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.moes = list(moes)
        #: Where collective tensors live: the weights' device (gloo takes CPU tensors).
        self.device = moes[0].router.device
        #: Why an exchange failed (a peer died, a timeout); the rank must stop once set.
        self.broken: str | None = None
        self.load = ExpertLoad(len(moes), moes[0].num_experts, window)
        self.stats = TrafficStats(per_rank_pairs=[0] * len(moes))
        #: Reads expert ``e`` of MoE layer ``i`` from the checkpoint (``fetch(i, e)`` -> gate_up,
        #: down); with it, rebalances read the experts a rank lacks instead of receiving them.
        self.fetch = fetch
        if slots is not None and len(slots) != len(moes):
            raise ConfigError(f"{len(slots)} loaded slot sets for {len(moes)} MoE layers")
        self.layers = [
            _LayerExperts(self, i, m, p, None if slots is None else slots[i])
            for i, (m, p) in enumerate(zip(moes, placements))
        ]
        for moe, layer in zip(self.moes, self.layers):
            moe.expert_backend = layer

    def slot_sets(self) -> list[ExpertSlots]:
        """This rank's slots of every MoE layer, as they are now."""
        return [
            ExpertSlots(layer.placement.rank_slots(self.rank), layer.gate_up, layer.down)
            for layer in self.layers
        ]

    @property
    def placements(self) -> list[Placement]:
        """Each MoE layer's current placement."""
        return [layer.placement for layer in self.layers]

    def idle_pass(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        """Join every MoE layer's exchanges with no tokens (a rank with nothing scheduled while
        others run their step)."""
        empty = torch.empty(0, hidden_size, dtype=dtype, device=device)
        for moe, layer in zip(self.moes, self.layers):
            layer.forward(moe, empty)

    def global_load(self) -> torch.Tensor:
        """The window's expert loads ``[layers, experts]`` summed over every rank (a collective)."""
        totals = self.load.totals().to(self.device)
        dist.all_reduce(totals, group=self.group)
        return totals.cpu()

    def rebalance(self, placements: Sequence[Placement]) -> int:
        """Move expert weights to ``placements`` (every rank calls this with the same ones); the bytes
        this rank sent."""
        sent = sum(layer.move_to(p) for layer, p in zip(self.layers, placements))
        self.stats.rebalance_bytes += sent
        return sent
