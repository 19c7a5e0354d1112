"""Budget-aware closing on the real default model: ``SamplingParams(close_on_length=True)``."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from agent_infer import SamplingParams
from agent_infer.errors import InvalidRequestError

# A document the model cannot finish in a few dozen tokens: a long free-text field first.
SCHEMA = {
    "type": "object",
    "properties": {
        "story": {"type": "string"},
        "rating": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    },
    "required": ["story", "rating", "tags"],
}
PROMPT = [
    {
        "role": "user",
        "content": "Write a JSON object with a very long story about a dragon, a rating and tags.",
    }
]


@pytest.mark.parametrize("max_tokens", [24, 40])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_closes_within_budget(llm: Any, max_tokens: int, temperature: float) -> None:
    params = SamplingParams(
        temperature=temperature, seed=3, max_tokens=max_tokens, structured=SCHEMA, close_on_length=True
    )
    out = llm.chat([PROMPT], params)[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop", completion
    assert len(completion.token_ids) <= max_tokens
    value = json.loads(completion.text)
    jsonschema.validate(value, SCHEMA)
    assert completion.parsed == value
    assert out.metrics.num_closing_tokens > 0


def test_without_closing_the_same_request_runs_out(llm: Any) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, structured=SCHEMA)
    out = llm.chat([PROMPT], params)[0]
    assert out.outputs[0].finish_reason == "length"
    assert out.metrics.num_closing_tokens == 0


def test_closing_keeps_outputs_that_fit(llm: Any) -> None:
    # With room to spare, closing changes nothing: same tokens as without it.
    small = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    prompt = [{"role": "user", "content": "Is the sky blue? Answer as JSON."}]
    plain = llm.chat([prompt], SamplingParams(temperature=0.0, max_tokens=64, structured=small))[0]
    closing = llm.chat(
        [prompt], SamplingParams(temperature=0.0, max_tokens=64, structured=small, close_on_length=True)
    )[0]
    assert plain.outputs[0].finish_reason == "stop"
    assert closing.outputs[0].token_ids == plain.outputs[0].token_ids
    assert closing.metrics.num_closing_tokens == 0


def test_budget_below_the_shortest_document_reports_length(llm: Any) -> None:
    # The shortest valid document needs more than 3 tokens: nothing to guarantee, usual "length".
    params = SamplingParams(temperature=0.0, max_tokens=3, structured=SCHEMA, close_on_length=True)
    out = llm.chat([PROMPT], params)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 3


def test_mixed_batch_closes_only_those_asking(llm: Any) -> None:
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, structured=SCHEMA, close_on_length=True),
        SamplingParams(temperature=0.0, max_tokens=30, structured=SCHEMA),
        SamplingParams(temperature=0.0, max_tokens=30),
    ]
    outs = llm.chat([PROMPT] * 3, params)
    assert outs[0].outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMA)
    assert outs[1].outputs[0].finish_reason == "length"
    assert outs[1].metrics.num_closing_tokens == 0 and outs[2].metrics.num_closing_tokens == 0


def test_invalid_combinations() -> None:
    with pytest.raises(InvalidRequestError, match="logprobs") as info:
        SamplingParams(structured=SCHEMA, close_on_length=True, logprobs=1)
    assert info.value.field == "close_on_length"
    with pytest.raises(InvalidRequestError, match="bool"):
        SamplingParams(close_on_length="yes")
