"""A sequence's logits must be bit-identical whether it runs alone or batched with others.

The engine relies on this for reproducible structured output: batching must not change a greedy
choice. With torch matmuls the model pads rows to a multiple of 4 (MKL computes a row the same way
for any such row count); with the native packed kernel (GGUF, CPU, fp32) every row count is exact
by construction and nothing is padded. Attention runs per sequence on both paths.
"""

from __future__ import annotations

import pytest
import torch

from agent_infer.model.loader import LoadedModel, default_model_path, load_model
from agent_infer.model.runner import SequenceRunner

PROMPTS = [
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish, French and German, then explain the differences.",
    "Hi",
    "What is 12 * 7?",
    "Give me a JSON object with keys name and age for a fictional person living in a small town.",
    "Why is the sky blue?",
    "Summarize: The quick brown fox jumps over the lazy dog. The dog did not react at all.",
]


@pytest.fixture(
    scope="module",
    params=[(torch.float32, True), (torch.float32, False), (torch.bfloat16, False)],
    ids=["fp32-native", "fp32-torch", "bf16"],
)
def lm(request: pytest.FixtureRequest) -> LoadedModel:
    dtype, native = request.param
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENT_INFER_NATIVE_LINEAR", "1" if native else "0")
        loaded = load_model(default_model_path(), device=torch.device("cpu"), dtype=dtype)
    assert loaded.model.native == native
    return loaded


def _prompts(lm: LoadedModel) -> list[list[int]]:
    tok = lm.tokenizer
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}])) for p in PROMPTS]


def test_linear_rows_do_not_depend_on_batch_size(lm: LoadedModel) -> None:
    """The LM head (largest matmul): the native kernel's guarantee, or the MKL property padding relies on."""
    w = lm.model.embed  # 49152 x 576, the largest matmul (LM head)
    x = torch.randn(67, w.shape[1], generator=torch.Generator().manual_seed(0))
    one = lm.model.compute_logits(x[:1])
    for m in (2, 3, 5, 8, 13, 67):
        assert torch.equal(lm.model.compute_logits(x[:m])[:1], one), m


def test_logits_alone_equal_logits_in_batch(lm: LoadedModel) -> None:
    prompts = _prompts(lm)
    steps = 4
    target = 2  # a long prompt, batched with shorter and longer ones

    alone = SequenceRunner(lm.model, num_blocks=64, block_size=16)
    ref = [alone.step([(target, prompts[target])])[0]]
    for _ in range(steps):
        ref.append(alone.step([(target, [int(ref[-1].argmax())])])[0])

    batched = SequenceRunner(lm.model, num_blocks=64, block_size=16)
    # step 0: prefill of all 8 together; then decode steps where the other sequences also decode
    logits = batched.step([(i, p) for i, p in enumerate(prompts)])
    got = [logits[target]]
    nxt = logits.argmax(-1).tolist()
    for _ in range(steps):
        logits = batched.step([(i, [nxt[i]]) for i in range(len(prompts))])
        got.append(logits[target])
        nxt = logits.argmax(-1).tolist()
    for step, (a, b) in enumerate(zip(ref, got)):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item():.3g}"


def test_decode_mixed_with_prefill_of_others(lm: LoadedModel) -> None:
    """Continuous batching: one sequence decodes while others prefill in the same forward."""
    prompts = _prompts(lm)
    alone = SequenceRunner(lm.model, num_blocks=64, block_size=16)
    first = alone.step([(0, prompts[0])])[0]
    ref = alone.step([(0, [int(first.argmax())])])[0]

    mixed = SequenceRunner(lm.model, num_blocks=64, block_size=16)
    mixed.step([(0, prompts[0])])
    logits = mixed.step([(5, prompts[5]), (0, [int(first.argmax())]), (3, prompts[3])])
    assert torch.equal(logits[1], ref)


@pytest.mark.parametrize("chunk", [2, 3, 5])
def test_short_chunk_rows_equal_decoding_token_by_token(lm: LoadedModel, chunk: int) -> None:
    """Forced tokens and drafts feed several tokens of one sequence at once. On the native path each
    of their query rows attends exactly as decoding that token alone would, so jump-forward and
    speculation leave the logits bit-identical to plain decoding (other paths: within rounding)."""
    prompt = _prompts(lm)[2]
    tokens = [
        int(t) for t in torch.randint(100, 40000, (chunk,), generator=torch.Generator().manual_seed(chunk))
    ]
    one = SequenceRunner(lm.model, num_blocks=64, block_size=16)
    one.step([(0, prompt)])
    ref = [one.step([(0, [t])])[0] for t in tokens][-1]
    fed = SequenceRunner(lm.model, num_blocks=64, block_size=16)
    fed.step([(0, prompt)])
    got = fed.step([(0, tokens)])[0]
    if lm.model.native:
        assert torch.equal(got, ref), f"max diff {(got - ref).abs().max().item():.3g}"
    elif lm.model.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    else:
        pytest.skip("bf16 SDPA over a chunk rounds differently from one-token steps (no claim there)")


def test_prompt_prefill_equals_decoding_token_by_token(lm: LoadedModel) -> None:
    """On the native path every prompt row attends as decoding that token alone would (the tiled
    kernel keeps the one-row arithmetic, any chunk length): one prefill, a chunked prefill (as after
    a prefix-cache hit) and token-by-token decoding give the same bits (other paths: within rounding).
    Prompts past 512 tokens: tests/model/test_long_prompt_invariance.py."""
    prompt = _prompts(lm)[5]
    assert len(prompt) > 20
    whole = SequenceRunner(lm.model, num_blocks=64, block_size=16).step([(0, prompt)])[0]
    chunked = SequenceRunner(lm.model, num_blocks=64, block_size=16)
    chunked.step([(0, prompt[:16])])
    split = chunked.step([(0, prompt[16:])])[0]
    one = SequenceRunner(lm.model, num_blocks=64, block_size=16)
    for t in prompt:
        stepped = one.step([(0, [t])])[0]
    if lm.model.native:
        assert torch.equal(whole, stepped), f"max diff {(whole - stepped).abs().max().item():.3g}"
        assert torch.equal(whole, split)
    elif lm.model.dtype == torch.float32:
        torch.testing.assert_close(whole, stepped, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(whole, split, rtol=2e-2, atol=2e-2)
    else:
        pytest.skip("bf16 SDPA over a prompt rounds differently from one-token steps (no claim there)")
