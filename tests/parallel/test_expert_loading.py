"""A rank under expert parallelism reads only its experts' tensors from the safetensors files (the
trained tiny V3 and V4, block FP8): its slots hold exactly what a full load holds for those experts,
the other experts are never read nor materialised, the replicated parts equal a full load's, and a
file-sourced weight move reads one expert as the full load has it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from agent_infer.model.layers.moe import MoE
from agent_infer.model.loader import load_model
from agent_infer.parallel.eplb import Placement, balanced_placement, contiguous_placement
from agent_infer.parallel.expert_loading import decoder_moes, load_rank_weights, resident_weight_bytes

CPU = torch.device("cpu")


def _stored_expert_bytes(path: str) -> int:
    """Bytes one routed expert's tensors take in the file (the checkpoints store them in bf16)."""
    with safe_open(str(Path(path) / "model.safetensors"), framework="pt") as f:
        names = [n for n in f.keys() if ".experts.1." in n and "layers.1." in n and "scale" not in n]  # noqa: SIM118
        return sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in names)


def _skewed(moes: list[MoE]) -> list[Placement]:
    """8 experts + 2 redundant over 2 ranks, expert 3 hot: replicated, so a rank holds it twice."""
    load = [1.0] * moes[0].num_experts
    load[3] = 50.0
    return [balanced_placement(load, 2, 5) for _ in moes]


@pytest.mark.parametrize("checkpoint", ["trained_v3", "trained_v4"])
def test_a_rank_reads_and_holds_only_its_experts(checkpoint: str, request: pytest.FixtureRequest) -> None:
    path = request.getfixturevalue(checkpoint)
    full = load_model(path)
    full_moes = decoder_moes(full.model)
    full_bytes = resident_weight_bytes(full.model)
    expert_bytes = sum(m.gate_up.numel() + m.down.numel() for m in full_moes) * 4
    for rank in range(2):
        w = load_rank_weights(path, CPU, torch.float32, rank, _skewed)
        assert w.checkpoint is not None
        for i, (moe, slots, placement) in enumerate(zip(w.moes, w.slots, w.placements)):
            mine = placement.rank_slots(rank)
            assert slots.experts == mine and len(mine) == 5
            # Shapes only: the [E, ...] tensors never had memory.
            assert moe.gate_up.is_meta and moe.down.is_meta
            want_up, want_down = full_moes[i].routed_weights(mine)  # read back from the packed copies
            assert torch.equal(slots.gate_up, want_up)
            assert torch.equal(slots.down, want_down)
            assert w.checkpoint.stats.experts_read[i] == set(mine)  # nothing of the other rank's
        held = resident_weight_bytes(w.loaded.model, w.slots)
        distinct = sum(len(set(s.experts)) for s in w.slots)
        per_expert = expert_bytes // (len(full_moes) * full_moes[0].num_experts)
        assert held == full_bytes - expert_bytes + sum(len(s.experts) for s in w.slots) * per_expert
        assert w.checkpoint.stats.expert_bytes_read == distinct * _stored_expert_bytes(path)
        mine_params = dict(w.loaded.model.named_parameters())
        for name, p in full.model.named_parameters():
            if not mine_params[name].is_meta:  # replicated parts (MTP experts included)
                assert torch.equal(mine_params[name], p), name
        up, down = w.checkpoint.read_expert(1, 6, CPU)
        want_up, want_down = full_moes[1].routed_weights([6])
        assert torch.equal(up, want_up[0]) and torch.equal(down, want_down[0])
        assert 6 in w.checkpoint.stats.experts_read[1]


def test_the_mtp_module_keeps_all_its_experts(trained_v3: str) -> None:
    w = load_rank_weights(
        trained_v3, CPU, torch.float32, 1, lambda moes: [contiguous_placement(8, 2, 4) for _ in moes]
    )
    mtp = [m for m in w.loaded.model.modules() if isinstance(m, MoE) and all(m is not e for e in w.moes)]
    assert len(mtp) == 1
    up, down = mtp[0].routed_weights(range(8))  # held (packed or as torch weights) for all 8
    assert not up.is_meta and up.shape[0] == 8 and down.shape[0] == 8
