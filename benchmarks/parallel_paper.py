"""The paper model of parallel MoE serving at DeepSeek-V3 scale (``bench_parallel.py --paper-only``).

Bytes a token sends through the all-to-all per MoE layer (ours: bf16 rows out once per remote rank,
one bf16 row back per remote (token, expert) pair; DeepEP: FP8 rows out with their scales, bf16
partial sums back per rank), the expected distinct destination ranks from a Monte Carlo of uniform
group-limited routing, the expert imbalance (max/mean rank load) without EPLB and with its global
and hierarchical policies over log-normal per-layer loads, and the weights each rank holds.
"""

from __future__ import annotations

import random
import statistics

from agent_infer.parallel.eplb import balanced_placement, contiguous_placement

#: DeepSeek-V3 (671B) sizes for the paper model.
V3 = dict(hidden=7168, experts=256, top_k=8, groups=8, topk_groups=4, moe_layers=58, moe_inter=2048)
#: DeepSeek-V3's parameters (without the MTP module): the routed experts, and the rest (attention,
#: the 3 dense layers, shared experts, routers, embedding, head), which every rank holds.
V3_PARAMS = 671e9
V3_EXPERT_PARAMS = 3 * V3["hidden"] * V3["moe_inter"]


def distinct_ranks(ranks: int, samples: int = 20000, seed: int = 0) -> float:
    """Expected distinct destination ranks of a token under V3's group-limited top-8 (4 of 8 groups),
    experts placed contiguously (a uniform router; a model of the traffic, not a measurement)."""
    rng = random.Random(seed)
    per_rank = V3["experts"] / ranks
    group = V3["experts"] // V3["groups"]
    total = 0
    for _ in range(samples):
        groups = rng.sample(range(V3["groups"]), V3["topk_groups"])
        pool = [g * group + i for g in groups for i in range(group)]
        experts = rng.sample(pool, V3["top_k"])
        total += len({int(e // per_rank) for e in experts})
    return total / samples


def skewed_load(seed: int) -> list[float]:
    """One layer's expert loads: log-normal (sigma 1), a stand-in for measured routing statistics."""
    rng = random.Random(seed)
    return [rng.lognormvariate(0.0, 1.0) for _ in range(V3["experts"])]


def paper_model() -> None:
    h, k, layers = V3["hidden"], V3["top_k"], V3["moe_layers"]
    print("\n### Paper model at DeepSeek-V3 scale\n")
    print(
        "Bytes a token sends through the all-to-all per MoE layer (dispatch + combine, remote destinations "
        "only), times 58 MoE layers; imbalance = max/mean rank load over 20 log-normal layer loads.\n"
    )
    print(
        "| ranks | slots/rank | ours: bf16 out per rank, bf16 back per pair KB | DeepEP: fp8 out, bf16 back, per rank KB "
        "| distinct ranks/token | MB/token, 58 layers (ours) | MB/token (DeepEP) | imbalance no EPLB "
        "| EPLB global | EPLB hierarchical (8 ranks/node) | weights per rank GB (FP8), of 671 |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    routed = V3["experts"] * V3["moe_layers"] * V3_EXPERT_PARAMS
    replicated = V3_PARAMS - routed
    for ranks, redundant in ((8, 32), (64, 64)):
        remote = (ranks - 1) / ranks
        d = distinct_ranks(ranks)
        ours = d * remote * h * 2 + k * remote * h * 2
        deepep = d * remote * h * (1 + 2) + d * remote * (h // 128) * 4  # fp8 rows + their scales
        slots = (V3["experts"] + redundant) // ranks
        before, glob, hier = [], [], []
        for seed in range(20):
            load = skewed_load(seed)
            before.append(contiguous_placement(V3["experts"], ranks, V3["experts"] // ranks).imbalance(load))
            glob.append(balanced_placement(load, ranks, slots, num_groups=V3["groups"]).imbalance(load))
            nodes = max(1, ranks // 8)
            hier.append(
                balanced_placement(load, ranks, slots, num_groups=V3["groups"], num_nodes=nodes).imbalance(
                    load
                )
            )
        hier_text = f"{statistics.mean(hier):.3f}" if ranks > 8 else "(one node: global)"
        print(
            f"| {ranks} | {slots} | {ours / 1e3:.1f} | {deepep / 1e3:.1f} | {d:.2f} | {ours * layers / 1e6:.2f} "
            f"| {deepep * layers / 1e6:.2f} | {statistics.mean(before):.2f} | {statistics.mean(glob):.3f} "
            f"| {hier_text} | {(replicated + V3['moe_layers'] * slots * V3_EXPERT_PARAMS) / 1e9:.0f} |"
        )
