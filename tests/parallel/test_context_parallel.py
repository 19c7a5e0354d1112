"""Balanced context-parallel prefill: the zig-zag split evens causal work, the log-sum-exp merge is
exact attention, and a long prompt prefilled over 2 gloo ranks gives single-rank logits within
float32 tolerance on a tiny random DeepSeek V3."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from deepseek_support import load_ours, save_tiny
from parallel_support import run_ranks

from agent_infer.errors import ConfigError
from agent_infer.model.runner import SequenceRunner
from agent_infer.parallel.context_parallel import (
    attend_with_lse,
    context_parallel_prefill,
    lse_merge,
    zigzag_chunks,
)

pytest.importorskip("transformers")
PROMPT_LEN = 100  # past original_max_position_embeddings=32: YaRN positions included


def test_zigzag_gives_each_rank_an_early_and_a_late_chunk() -> None:
    plan = zigzag_chunks(100, 4)
    assert plan[0] == [(0, 13), (88, 100)] and plan[3] == [(39, 52), (52, 64)]
    covered = sorted(p for chunks in plan for a, b in chunks for p in range(a, b))
    assert covered == list(range(100))

    # causal work of a rank: for each query, the keys it sees; equal when 2R divides the length
    def work(plan: list[list[tuple[int, int]]]) -> list[int]:
        return [sum(p + 1 for a, b in chunks for p in range(a, b)) for chunks in plan]

    assert len(set(work(zigzag_chunks(96, 4)))) == 1
    assert max(work(plan)) / min(work(plan)) < 1.1
    contiguous = [sum(p + 1 for p in range(r * 25, (r + 1) * 25)) for r in range(4)]
    assert max(contiguous) / min(contiguous) > 5
    with pytest.raises(ConfigError, match="cannot be split"):
        zigzag_chunks(5, 4)


def test_lse_merge_of_key_pieces_is_exact_attention() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(4, 30, 16, generator=gen) for _ in range(3))
    pos = torch.arange(30)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)
    pieces = [
        attend_with_lse(q, k[:, a:b], v[:, a:b], pos, pos[a:b], 0.25) for a, b in ((0, 7), (7, 19), (19, 30))
    ]
    got = lse_merge([p[0] for p in pieces], [p[1] for p in pieces])
    assert (got - want).abs().max().item() < 1e-5


def _cp_rank(rank: int, world: int, directory: str, prompt: list[int]) -> list[torch.Tensor]:
    """All-position logits on the torch kernels, then on the packed native ones (the CPU default)."""
    out = []
    for packed in (False, True):
        model = load_ours(Path(directory), packed=packed)
        result = context_parallel_prefill(model, prompt, all_logits=True)  # type: ignore[arg-type]
        assert len(result.latents) == model.config.num_layers
        out.append(result.logits)
    return out


def test_two_rank_prefill_equals_single_rank(tmp_path: Path) -> None:
    """Within 1e-4 absolute of one rank's logits (and of transformers'), on both kernels: the
    attention's softmax is summed in pieces, so not bit for bit."""
    hf = save_tiny(tmp_path)
    prompt = torch.randint(2, 256, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()
    ranks = run_ranks(_cp_rank, 2, str(tmp_path), prompt, timeout=120)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    assert want.abs().max().item() > 1.0
    for packed in (False, True):
        logits = [r[packed] for r in ranks]
        assert torch.equal(logits[0], logits[1])
        model = load_ours(tmp_path, packed=packed)
        assert (model.kernels.name == "packed-float") == packed
        single = SequenceRunner(model, num_blocks=16, block_size=8).step([(0, prompt)])[0]
        assert (logits[0][-1] - single).abs().max().item() <= 1e-4
        assert (logits[0] - want).abs().max().item() <= 1e-4  # every position, not only the last
