"""Prompts longer than a chunk limit keep bit-identical logits on every engine path (native path).

Every row of every chunk goes through the native attention kernel with the arithmetic of decoding
that token alone, so a prompt's logits cannot depend on how it was cut into chunks (the step
budget, the other requests of the batch) or on which of its blocks came from the prefix cache.
Compared here through ``LLM``/``LLMEngine``: the greedy tokens and their top-5 log-probabilities,
bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from agent_infer import LLM, SamplingParams
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.model.loader import LoadedModel, default_model_path, load_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=3, logprobs=5)


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    lm = load_model(default_model_path(), device=torch.device("cpu"), dtype=torch.float32)
    if not lm.model.native:
        pytest.skip("the native path is not available (extension missing or turned off)")
    return lm


def _llm(loaded: LoadedModel, **config: object) -> LLM:
    cfg = EngineConfig.from_kwargs(num_kv_blocks=400, speculative_tokens=0, **config)
    return LLM.from_engine(LLMEngine(None, cfg, loaded=loaded))


def _ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=gen).tolist()


def _result(llm: LLM, prompts: list[list[int]], index: int = 0) -> tuple[list[int], object]:
    out = llm.generate(prompts, PARAMS)[index]
    return out.token_ids, out.outputs[0].logprobs


def test_long_prompt_equal_cold_chunked_cached_and_batched(loaded: LoadedModel) -> None:
    gen = torch.Generator().manual_seed(1200)
    shared = _ids(gen, 1000)
    prompt, sibling = shared + _ids(gen, 200), shared + _ids(gen, 150)
    ref = _result(_llm(loaded, enable_prefix_caching=False), [prompt])
    for budget in (256, 700):  # chunked prefill cut at different places
        got = _result(_llm(loaded, enable_prefix_caching=False, max_num_batched_tokens=budget), [prompt])
        assert got == ref, f"max_num_batched_tokens={budget}"
    cached = _llm(loaded, enable_prefix_caching=True)
    cached.generate([sibling], PARAMS)
    out = cached.generate([prompt], PARAMS)[0]
    assert out.num_cached_tokens >= 992  # the sibling's blocks of the shared 1,000 tokens
    assert (out.token_ids, out.outputs[0].logprobs) == ref
    # In a batch the first step cuts the prompt where its neighbours leave room, and once they
    # decode it is fed 16 tokens a step.
    batched = _llm(loaded, enable_prefix_caching=False)
    assert _result(batched, [_ids(gen, 900), prompt, _ids(gen, 400)], index=1) == ref


def test_prefix_cached_by_a_longer_prompt(loaded: LoadedModel) -> None:
    """A shared prefix cached by a 515-token prompt, then reused by a 510-token one, gives the same
    bits as the 510-token prompt alone (the chunks straddle the former 512-row native limit)."""
    gen = torch.Generator().manual_seed(515)
    shared = _ids(gen, 500)
    longer, shorter = shared + _ids(gen, 15), shared + _ids(gen, 10)
    ref = _result(_llm(loaded, enable_prefix_caching=False), [shorter])
    llm = _llm(loaded, enable_prefix_caching=True)
    llm.generate([longer, _ids(gen, 300)], PARAMS)
    out = llm.generate([shorter], PARAMS)[0]
    assert out.num_cached_tokens >= 496
    assert (out.token_ids, out.outputs[0].logprobs) == ref
