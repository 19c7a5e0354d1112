"""EPLB placements: every expert hosted, replicas for hot experts, imbalance (max/mean rank load)
dropping on skewed loads, hierarchical packing of whole groups per node, and the sliding window."""

from __future__ import annotations

import random

import pytest
import torch

from agent_infer.errors import ConfigError
from agent_infer.parallel.eplb import balanced_placement, contiguous_placement, pack, replicate
from agent_infer.parallel.load_stats import ExpertLoad, load_profile, save_profile


def _zipf(num_experts: int, seed: int = 0) -> list[float]:
    """Most tokens on a few experts (Zipf over a shuffled order)."""
    order = list(range(num_experts))
    random.Random(seed).shuffle(order)
    load = [0.0] * num_experts
    for rank, e in enumerate(order):
        load[e] = 10000.0 / (rank + 1) ** 1.2
    return load


@pytest.mark.parametrize(("experts", "ranks", "slots"), [(8, 2, 5), (16, 4, 5), (64, 8, 9), (256, 64, 5)])
def test_global_placement_cuts_imbalance_on_skewed_load(experts: int, ranks: int, slots: int) -> None:
    load = _zipf(experts)
    base = contiguous_placement(experts, ranks, slots)
    placed = balanced_placement(load, ranks, slots)
    assert sorted(set(placed.slots)) == list(range(experts))
    assert sum(placed.replicas) == ranks * slots
    before, after = base.imbalance(load), placed.imbalance(load)
    assert after < before
    assert after < 1.35, (before, after)
    hottest = max(range(experts), key=lambda e: load[e])
    assert placed.replicas[hottest] == max(placed.replicas) > 1


def test_hierarchical_keeps_groups_on_one_node_and_balances_nodes() -> None:
    experts, groups, nodes, ranks, slots = 32, 8, 2, 4, 10
    load = _zipf(experts, seed=3)
    placed = balanced_placement(load, ranks, slots, num_groups=groups, num_nodes=nodes)
    per_node = ranks // nodes * slots
    size = experts // groups
    for node in range(nodes):
        hosted = set(placed.slots[node * per_node : (node + 1) * per_node])
        for g in range(groups):
            members = set(range(g * size, (g + 1) * size))
            assert members <= hosted or not (members & hosted)  # a group lives on one node
    assert placed.imbalance(load) < contiguous_placement(experts, ranks, slots).imbalance(load)


def test_uniform_load_is_already_balanced() -> None:
    placed = balanced_placement([5.0] * 16, 4, 4)
    assert placed.imbalance([5.0] * 16) == 1.0
    assert placed.replicas == [1] * 16


def test_replicate_and_pack() -> None:
    assert replicate([8.0, 1.0, 1.0], 5) == [3, 1, 1]
    packs = pack([9.0, 7.0, 6.0, 5.0, 4.0, 1.0], 2)
    assert sorted(len(p) for p in packs) == [3, 3]
    totals = sorted(sum([9.0, 7.0, 6.0, 5.0, 4.0, 1.0][i] for i in p) for p in packs)
    assert totals == [15.0, 17.0]  # greedy: 9+5+1 and 7+6+4 (the heaviest go first)


def test_bad_sizes_raise_config_errors() -> None:
    with pytest.raises(ConfigError, match="cannot host"):
        balanced_placement([1.0] * 8, 2, 3)
    with pytest.raises(ConfigError, match="num_groups"):
        balanced_placement([1.0] * 8, 2, 4, num_groups=3)
    with pytest.raises(ConfigError, match="num_nodes"):
        balanced_placement([1.0] * 8, 3, 4, num_nodes=2)


def test_window_forgets_old_steps() -> None:
    load = ExpertLoad(num_layers=1, num_experts=4, window=2)
    load.record(0, torch.tensor([[0, 1]]))
    load.advance()
    load.record(0, torch.tensor([[2, 2]]))
    assert load.totals().tolist() == [[1, 1, 2, 0]]
    load.advance()  # the first step leaves the window
    load.record(0, torch.tensor([[3, 3]]))
    assert load.totals().tolist() == [[0, 0, 2, 2]]


def test_profile_round_trip_and_shape_check(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "load.json"
    save_profile(path, torch.tensor([[1, 2, 3, 4]]))
    assert load_profile(path, 1, 4).tolist() == [[1.0, 2.0, 3.0, 4.0]]
    with pytest.raises(ConfigError, match=r"shape \(1, 4\)"):
        load_profile(path, 2, 4)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match=r"bad\.json"):
        load_profile(tmp_path / "bad.json", 1, 4)
