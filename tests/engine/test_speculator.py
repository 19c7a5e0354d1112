"""Speculative decoding (prompt-lookup drafts) on the real default model, plus its pieces alone."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import torch

from agent_infer import SamplingParams
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.speculator import verify_rows
from agent_infer.errors import ConfigError
from agent_infer.structured import StructuredOutput

# Prompts whose answers copy from the prompt, so drafts are found and mostly accepted.
COPY_PROMPTS = [
    [
        {
            "role": "user",
            "content": "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox",
        }
    ],
    [
        {
            "role": "user",
            "content": "List the numbers 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 again, separated by commas.",
        }
    ],
    [{"role": "user", "content": "Write the word banana five times: banana banana banana"}],
]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4},
    },
    "required": ["name", "city", "age", "languages"],
    "additionalProperties": False,
}
PERSON_PROMPT = [
    {
        "role": "user",
        "content": 'Example: {"name": "Ada Lovelace", "city": "London", "age": 36, "languages": '
        '["English", "French"]}. Give the same JSON object for Ada Lovelace.',
    }
]


@pytest.fixture(scope="module")
def pair(make_llm: Callable[..., Any]) -> tuple[Any, Any]:
    """The same engine without and with drafts (prefix caching off so both run the same steps)."""
    return (
        make_llm(enable_prefix_caching=False, speculative_tokens=0, boundary_drafts=False),
        make_llm(enable_prefix_caching=False, speculative_tokens=5),
    )


def _chat(llm: Any, prompts: list[Any], params: SamplingParams) -> list[Any]:
    ids = [
        llm.tokenizer.encode(llm.tokenizer.apply_chat_template(p, add_generation_prompt=True))
        for p in prompts
    ]
    return llm.generate(ids, params)


def test_greedy_unconstrained_matches_plain_decoding(pair: tuple[Any, Any]) -> None:
    plain, spec = pair
    params = SamplingParams(temperature=0.0, max_tokens=40)
    a = _chat(plain, COPY_PROMPTS, params)
    b = _chat(spec, COPY_PROMPTS, params)
    for x, y in zip(a, b):
        assert y.outputs[0].token_ids == x.outputs[0].token_ids
        assert y.outputs[0].finish_reason == x.outputs[0].finish_reason
    drafted = sum(o.metrics.num_draft_tokens for o in b)
    accepted = sum(o.metrics.num_accepted_draft_tokens for o in b)
    assert drafted > 0 and 0 < accepted <= drafted
    assert all(o.metrics.num_draft_tokens == 0 for o in a)


def test_max_tokens_and_stop_strings_hold_with_drafts(pair: tuple[Any, Any]) -> None:
    plain, spec = pair
    for max_tokens in (1, 7, 13):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        x, y = _chat(plain, COPY_PROMPTS[:1], params)[0], _chat(spec, COPY_PROMPTS[:1], params)[0]
        assert len(y.outputs[0].token_ids) <= max_tokens
        assert y.outputs[0].token_ids == x.outputs[0].token_ids
    params = SamplingParams(temperature=0.0, max_tokens=40, stop=["lazy"])
    x, y = _chat(plain, COPY_PROMPTS[:1], params)[0], _chat(spec, COPY_PROMPTS[:1], params)[0]
    assert y.outputs[0].text == x.outputs[0].text
    assert "lazy" not in y.outputs[0].text


@pytest.mark.parametrize("forced", [True, False])
def test_constrained_greedy_with_drafts_is_valid_and_same_text(
    make_llm: Callable[..., Any], pair: tuple[Any, Any], forced: bool
) -> None:
    plain = (
        pair[0]
        if forced
        else make_llm(
            enable_prefix_caching=False, forced_tokens=False, speculative_tokens=0, boundary_drafts=False
        )
    )
    spec = make_llm(enable_prefix_caching=False, forced_tokens=forced, speculative_tokens=5)
    params = SamplingParams(
        temperature=0.0, max_tokens=120, structured=StructuredOutput.json_schema(PERSON, whitespace="compact")
    )
    x, y = _chat(plain, [PERSON_PROMPT], params)[0], _chat(spec, [PERSON_PROMPT], params)[0]
    assert y.outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(y.outputs[0].text), PERSON)
    # A draft stops where jump-forward takes over, so even the tokens match plain decoding.
    assert y.outputs[0].token_ids == x.outputs[0].token_ids
    assert y.metrics.num_accepted_draft_tokens > 0


def test_boundary_drafts_alone_keep_the_tokens_and_save_steps(
    make_llm: Callable[..., Any], pair: tuple[Any, Any]
) -> None:
    """With n-gram drafts off, the forced text's unsafe last tokens are still drafted and verified."""
    boundary = make_llm(enable_prefix_caching=False, speculative_tokens=0, boundary_drafts=True)
    structured = StructuredOutput.json_schema(PERSON, whitespace="compact")
    params = SamplingParams(temperature=0.0, max_tokens=120, structured=structured)
    fed: list[list[tuple[int, ...]]] = []
    run = boundary.engine.runner.run
    boundary.engine.runner.run = lambda batch, *a: fed.append([i.draft for i in batch]) or run(batch, *a)
    x, y = _chat(pair[0], [PERSON_PROMPT], params)[0], _chat(boundary, [PERSON_PROMPT], params)[0]
    # The leading forced text's boundary rides along with the prompt's prefill.
    from agent_infer.engine.boundary_drafts import boundary_tokens
    from agent_infer.grammar import GrammarMatcher

    m = GrammarMatcher(boundary.engine.grammar.compile(structured.to_grammar()))
    for t in m.forced_tokens():
        assert m.accept_token(t)
    assert fed[0] == [tuple(boundary_tokens(m))] and fed[0][0]
    assert y.outputs[0].token_ids == x.outputs[0].token_ids
    assert x.metrics.num_draft_tokens == 0
    assert 0 < y.metrics.num_accepted_draft_tokens <= y.metrics.num_draft_tokens
    # Only forced text is drafted: every draft token is one the grammar fixed at that point.
    assert y.metrics.num_draft_tokens <= len(y.outputs[0].token_ids)


def test_seeded_sampling_gives_the_same_tokens_with_drafts(make_llm: Callable[..., Any]) -> None:
    plain = make_llm(speculative_tokens=0)
    spec = make_llm(speculative_tokens=4)
    structured = StructuredOutput.json_schema(PERSON)
    params = [
        SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=150, structured=structured)
        for s in range(4)
    ]
    params += [SamplingParams(temperature=0.7, seed=9 + s, max_tokens=30) for s in range(2)]
    # A mixed batch: unconstrained requests with drafts run next to the constrained ones.
    prompts = [PERSON_PROMPT] * 4 + COPY_PROMPTS[:2]
    a, b = _chat(plain, prompts, params), _chat(spec, prompts, params)
    for out in b[:4]:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    # Each row's token is drawn as plain decoding draws it, one number per emitted token.
    assert [o.outputs[0].token_ids for o in b] == [o.outputs[0].token_ids for o in a]
    assert sum(o.metrics.num_accepted_draft_tokens for o in b) > 0
    alone = _chat(spec, [prompts[5]], params[5:])[0]
    assert alone.outputs[0].token_ids == b[5].outputs[0].token_ids  # whatever the batch


def test_small_kv_pool_preempts_cleanly_with_drafts(
    make_llm: Callable[..., Any], pair: tuple[Any, Any]
) -> None:
    # 12 blocks of 16 tokens cannot hold three ~80-token sequences: preemption drops drafts.
    spec = make_llm(enable_prefix_caching=False, speculative_tokens=5, num_kv_blocks=12)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    a = _chat(pair[0], COPY_PROMPTS, params)
    b = _chat(spec, COPY_PROMPTS, params)
    assert [o.outputs[0].token_ids for o in b] == [o.outputs[0].token_ids for o in a]


def test_logprobs_and_penalties_never_draft(pair: tuple[Any, Any]) -> None:
    spec = pair[1]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=20, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.2),
    ):
        out = _chat(spec, COPY_PROMPTS[:1], params)[0]
        assert out.metrics.num_draft_tokens == 0
        assert out.outputs[0].token_ids
        if params.logprobs is not None:
            assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)


def test_speculative_sampling_keeps_the_distribution() -> None:
    probs = torch.tensor([0.1, 0.5, 0.05, 0.25, 0.1])
    logits = probs.log().unsqueeze(0).repeat(2, 1)
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(1234)
    trials = 20000
    counts = torch.zeros(5)
    for _ in range(trials):
        first = verify_rows(logits, [3], params, gen)[0][0]
        counts[first] += 1
    freq = counts / trials
    assert torch.allclose(freq, probs, atol=0.015), freq


def test_speculative_tokens_is_validated() -> None:
    with pytest.raises(ConfigError, match="speculative_tokens"):
        EngineConfig(speculative_tokens=-1)
    with pytest.raises(ConfigError, match="speculative_tokens"):
        EngineConfig(speculative_tokens=True)


def test_value_close_bias_with_drafts_keeps_the_tokens(make_llm: Callable[..., Any]) -> None:
    # The closing bias is applied to every draft row as if the draft prefix were accepted (the
    # matcher walks the draft and is rolled back), so drafting does not change the output.
    base = {"enable_prefix_caching": False, "forced_tokens": False, "boundary_drafts": False}
    plain = make_llm(speculative_tokens=0, **base)
    spec = make_llm(speculative_tokens=5, **base)
    schema = {
        "type": "object",
        "properties": {"words": {"type": "string"}},
        "required": ["words"],
        "additionalProperties": False,
    }
    prompt = [
        {"role": "user", "content": "Write the word 'go' forty times in the words field: go, go, go, go"}
    ]
    closing = {"value_close_multiplier": 2.0, "value_close_allowed": 2}
    params = SamplingParams(temperature=0.0, max_tokens=60, structured=schema, **closing)
    x, y = _chat(plain, [prompt], params)[0], _chat(spec, [prompt], params)[0]
    assert y.outputs[0].token_ids == x.outputs[0].token_ids
    assert y.metrics.num_draft_tokens > 0
    unbiased = _chat(plain, [prompt], SamplingParams(temperature=0.0, max_tokens=60, structured=schema))[0]
    assert unbiased.outputs[0].token_ids != x.outputs[0].token_ids  # the bias did act
