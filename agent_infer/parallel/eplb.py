"""Expert-parallel load balancing: which logical expert each physical expert slot holds.

Written from DeepSeek's published EPLB description. ``R`` ranks hold ``S`` expert slots each, so
``R * S >= E`` physical experts host ``E`` logical ones; the spare slots hold replicas of hot
experts, and a token routed to a replicated expert goes to one of its replicas, so each replica
carries ``load / replicas`` of that expert's tokens.

* **Hierarchical** (ranks form ``num_nodes`` equal nodes and the experts' routing groups divide
  evenly over them): whole expert groups are packed onto nodes so node loads are even (a token's
  group-limited top-k then stays on few nodes), the experts of each node are replicated inside the
  node's slots, and the node's physical experts are packed onto its ranks.
* **Global** (otherwise): experts are replicated over all slots regardless of groups, then packed
  onto ranks.

Replication is greedy: each spare slot goes to the expert whose per-replica load is largest.
Packing is greedy with equal capacities: items by decreasing weight, each to the lightest pack that
still has room. Ties break toward the lower index so every rank computes the same placement.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agent_infer.errors import ConfigError


@dataclass(frozen=True)
class Placement:
    """One MoE layer's placement: ``slots[p]`` is the logical expert of physical slot ``p``
    (rank ``p // slots_per_rank``)."""

    slots: tuple[int, ...]
    num_experts: int
    num_ranks: int
    slots_per_rank: int

    def __post_init__(self) -> None:
        if len(self.slots) != self.num_ranks * self.slots_per_rank:
            raise ConfigError(f"placement has {len(self.slots)} slots, expected ranks * slots_per_rank")
        if sorted(set(self.slots)) != list(range(self.num_experts)):
            raise ConfigError("placement must host every logical expert at least once")

    @property
    def replicas(self) -> list[int]:
        """Replica count of each logical expert."""
        counts = [0] * self.num_experts
        for e in self.slots:
            counts[e] += 1
        return counts

    def physical_of(self) -> list[list[int]]:
        """Per logical expert, its physical slots in ascending order (the logical->physical map)."""
        table: list[list[int]] = [[] for _ in range(self.num_experts)]
        for p, e in enumerate(self.slots):
            table[e].append(p)
        return table

    def rank_slots(self, rank: int) -> tuple[int, ...]:
        """The logical experts of ``rank``'s slots, in slot order."""
        s = self.slots_per_rank
        return self.slots[rank * s : (rank + 1) * s]

    def rank_loads(self, load: Sequence[float]) -> list[float]:
        """Each rank's load when every replica takes an equal share of its expert's load."""
        replicas = self.replicas
        out = [0.0] * self.num_ranks
        for p, e in enumerate(self.slots):
            out[p // self.slots_per_rank] += float(load[e]) / replicas[e]
        return out

    def imbalance(self, load: Sequence[float]) -> float:
        """max / mean of :meth:`rank_loads` (1.0 is perfect balance; 1.0 for zero load)."""
        loads = self.rank_loads(load)
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0


def contiguous_placement(num_experts: int, num_ranks: int, slots_per_rank: int) -> Placement:
    """The placement without load information: expert ``p % E`` in slot ``p`` (rank r holds a
    contiguous range when ``R * S == E``)."""
    _check_sizes(num_experts, num_ranks, slots_per_rank)
    return Placement(
        tuple(p % num_experts for p in range(num_ranks * slots_per_rank)),
        num_experts,
        num_ranks,
        slots_per_rank,
    )


def balanced_placement(
    load: Sequence[float],
    num_ranks: int,
    slots_per_rank: int,
    *,
    num_groups: int = 1,
    num_nodes: int = 1,
) -> Placement:
    """The EPLB placement of ``len(load)`` experts (``load[e]``: tokens routed to ``e``).

    Hierarchical when ``num_nodes > 1`` divides both ``num_ranks`` and ``num_groups``, global otherwise.
    Raises :class:`ConfigError` when the slots cannot host every expert.
    """
    num_experts = len(load)
    _check_sizes(num_experts, num_ranks, slots_per_rank)
    if num_groups < 1 or num_experts % num_groups:
        raise ConfigError(f"num_groups={num_groups} does not divide num_experts={num_experts}")
    if num_nodes < 1 or num_ranks % num_nodes:
        raise ConfigError(f"num_nodes={num_nodes} does not divide num_ranks={num_ranks}")
    weights = [max(float(x), 0.0) for x in load]
    hierarchical = num_nodes > 1 and num_groups % num_nodes == 0
    if hierarchical and (num_ranks * slots_per_rank) // num_nodes < num_experts // num_nodes:
        hierarchical = False
    if not hierarchical:
        flat = _place_on_ranks(list(range(num_experts)), weights, num_ranks, slots_per_rank)
        return Placement(tuple(flat), num_experts, num_ranks, slots_per_rank)
    group_size = num_experts // num_groups
    group_load = [sum(weights[g * group_size : (g + 1) * group_size]) for g in range(num_groups)]
    node_groups = pack(group_load, num_nodes)
    ranks_per_node = num_ranks // num_nodes
    slots: list[int] = []
    for groups in node_groups:
        experts = [g * group_size + i for g in sorted(groups) for i in range(group_size)]
        slots.extend(_place_on_ranks(experts, weights, ranks_per_node, slots_per_rank))
    return Placement(tuple(slots), num_experts, num_ranks, slots_per_rank)


def replicate(weights: Sequence[float], num_slots: int) -> list[int]:
    """Replica counts (each >= 1, summing to ``num_slots``) that greedily minimize the largest
    per-replica load."""
    if num_slots < len(weights):
        raise ConfigError(f"{num_slots} slots cannot host {len(weights)} experts")
    counts = [1] * len(weights)
    for _ in range(num_slots - len(weights)):
        best = max(range(len(weights)), key=lambda e: (weights[e] / counts[e], -e))
        counts[best] += 1
    return counts


def pack(weights: Sequence[float], num_packs: int) -> list[list[int]]:
    """Items (indices of ``weights``) in ``num_packs`` packs of equal count (``len % num_packs == 0``),
    heaviest first into the lightest pack with room."""
    if len(weights) % num_packs:
        raise ConfigError(f"{len(weights)} items do not split evenly into {num_packs} packs")
    capacity = len(weights) // num_packs
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    totals = [0.0] * num_packs
    for item in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        target = min((p for p in range(num_packs) if len(packs[p]) < capacity), key=lambda p: (totals[p], p))
        packs[target].append(item)
        totals[target] += weights[item]
    return packs


def _place_on_ranks(
    experts: list[int], weights: Sequence[float], num_ranks: int, slots_per_rank: int
) -> list[int]:
    """Replicate ``experts`` over ``num_ranks * slots_per_rank`` slots and pack them onto the ranks;
    the logical expert of each slot, rank by rank, each rank's slots in ascending expert order."""
    counts = replicate([weights[e] for e in experts], num_ranks * slots_per_rank)
    physical: list[int] = []  # logical expert of each physical item
    shares: list[float] = []
    for i, e in enumerate(experts):
        physical += [e] * counts[i]
        shares += [weights[e] / counts[i]] * counts[i]
    packs = _pack_distinct(physical, shares, num_ranks)
    return [physical[i] for p in packs for i in sorted(p, key=lambda i: (physical[i], i))]


def _pack_distinct(physical: list[int], shares: list[float], num_packs: int) -> list[list[int]]:
    """:func:`pack`, preferring a pack that does not already hold a replica of the same expert
    (two replicas on one rank would only add memory)."""
    capacity = len(physical) // num_packs
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    held: list[set[int]] = [set() for _ in range(num_packs)]
    totals = [0.0] * num_packs
    for item in sorted(range(len(physical)), key=lambda i: (-shares[i], i)):
        open_packs = [p for p in range(num_packs) if len(packs[p]) < capacity]
        fresh = [p for p in open_packs if physical[item] not in held[p]] or open_packs
        target = min(fresh, key=lambda p: (totals[p], p))
        packs[target].append(item)
        held[target].add(physical[item])
        totals[target] += shares[item]
    return packs


def _check_sizes(num_experts: int, num_ranks: int, slots_per_rank: int) -> None:
    for name, value in (
        ("num_experts", num_experts),
        ("num_ranks", num_ranks),
        ("slots_per_rank", slots_per_rank),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    if num_ranks * slots_per_rank < num_experts:
        raise ConfigError(
            f"{num_ranks} ranks x {slots_per_rank} slots = {num_ranks * slots_per_rank} cannot host "
            f"{num_experts} experts"
        )
