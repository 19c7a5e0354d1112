"""Expert parallelism over 2 real gloo ranks: a DeepSeek-V3-style MoE layer (sigmoid routing,
correction bias, group-limited top-k, shared experts) split by expert gives bit-identical outputs
to the single-process layer, before and after a rebalance that moves expert weights; so do
DeepSeek-V4-style layers, hash-routed and clamped by swiglu_limit."""

from __future__ import annotations

import torch
import torch.distributed as dist
from parallel_support import run_ranks

from agent_infer.model.layers.moe import MoE
from agent_infer.parallel.eplb import balanced_placement, contiguous_placement
from agent_infer.parallel.expert_parallel import ExpertParallel

HIDDEN, INTER, EXPERTS = 32, 16, 8


def _layer(seed: int) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(
        HIDDEN, INTER, EXPERTS, 3, scoring="sigmoid", routed_scaling_factor=2.5, score_bias=True,
        shared_intermediate_size=INTER, num_groups=4, topk_groups=2,
    )  # fmt: skip
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    assert layer.score_bias is not None
    layer.score_bias.data[:2] += 1.0  # experts 0 and 1 are hot: the rebalance has work to do
    return layer


def _tokens(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(100 + rank))


def _ep_rank(rank: int, world: int, slots: int, sizes: list[int]) -> dict:
    moes = [_layer(0), _layer(1)]
    refs = [_layer(0), _layer(1)]
    x = _tokens(rank, sizes[rank])
    want = [ref(x) if len(x) else x.clone() for ref in refs]
    start = [contiguous_placement(EXPERTS, world, slots) for _ in moes]
    ep = ExpertParallel(moes, start, rank=rank, world_size=world)
    got = [m(x) if len(x) else ep.layers[i].forward(m, x) for i, m in enumerate(moes)]
    load = ep.global_load()
    new = [balanced_placement(load[i].tolist(), world, slots, num_groups=4) for i in range(len(moes))]
    moved = ep.rebalance(new)
    after = [m(x) if len(x) else ep.layers[i].forward(m, x) for i, m in enumerate(moes)]
    return {
        "equal_before": all(torch.equal(g, w) for g, w in zip(got, want)),
        "equal_after": all(torch.equal(g, w) for g, w in zip(after, want)),
        "moved": moved,
        "imbalance": [
            (start[i].imbalance(load[i].tolist()), new[i].imbalance(load[i].tolist())) for i in range(2)
        ],
        "bytes": ep.stats.dispatch_bytes,
    }


def test_split_experts_bit_identical_and_rebalance_moves_weights() -> None:
    results = run_ranks(_ep_rank, 2, 5, [13, 6], timeout=120)  # 10 slots: 2 redundant experts
    for r in results:
        assert r["equal_before"] and r["equal_after"]
        assert r["bytes"] > 0
        for before, after in r["imbalance"]:
            assert after <= before
    assert sum(r["moved"] for r in results) > 0


def test_an_idle_rank_joins_the_exchange() -> None:
    results = run_ranks(_ep_rank, 2, 4, [9, 0], timeout=120)
    assert all(r["equal_before"] and r["equal_after"] for r in results)


def _v4_layer(seed: int, limit: float | None) -> MoE:
    """A DeepSeek-V4-style layer: sqrtsoftplus scores, one shared expert, swiglu_limit clamping."""
    torch.manual_seed(seed)
    layer = MoE(
        HIDDEN, INTER, EXPERTS, 2, scoring="sqrtsoftplus", routed_scaling_factor=1.5, score_bias=True,
        shared_intermediate_size=INTER, swiglu_limit=limit,
    )  # fmt: skip
    for p in layer.parameters():
        p.data.normal_(0, 0.5)
    return layer


def _hash_table(n: int, rank: int) -> torch.Tensor:
    """A hash-routed layer's experts for ``n`` tokens: a fixed table, not the scores' top-k."""
    ids = torch.arange(n) * 7 + rank * 3
    return torch.stack((ids % EXPERTS, (ids // 2 + 1) % EXPERTS), dim=1)


def _v4_rank(rank: int, world: int, sizes: list[int]) -> dict:
    x = 3.0 * _tokens(rank, sizes[rank])  # large enough for the clamp to act
    table = _hash_table(len(x), rank)
    moes = [_v4_layer(0, 0.5), _v4_layer(1, 0.5)]
    refs = [_v4_layer(0, 0.5), _v4_layer(1, 0.5)]
    unclamped = _v4_layer(0, None)
    want = [refs[0](x, table), refs[1](x)]  # layer 0 hash-routed, layer 1 score-routed
    ep = ExpertParallel(
        moes, [contiguous_placement(EXPERTS, world, 5) for _ in moes], rank=rank, world_size=world
    )
    got = [moes[0](x, table), moes[1](x)]
    return {
        "equal": all(torch.equal(g, w) for g, w in zip(got, want)),
        "clamp_acts": not torch.equal(unclamped(x, table), want[0]),
        "hash_matters": not torch.equal(refs[0](x), want[0]),
        "dispatched": ep.stats.dispatch_bytes > 0,
        "backend": dist.get_backend(),
    }


def test_hash_routed_and_clamped_layers_split_over_ranks_bit_identical() -> None:
    results = run_ranks(_v4_rank, 2, [11, 6], timeout=120)
    for r in results:
        assert r["equal"] and r["clamp_acts"] and r["hash_matters"] and r["dispatched"]
        assert r["backend"] == "gloo"  # the CPU accelerator's backend
