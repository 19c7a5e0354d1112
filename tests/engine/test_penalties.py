"""Repetition, presence and frequency penalties (vLLM / OpenAI semantics)."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import jsonschema
import pytest
import torch

from agent_infer import SamplingParams
from agent_infer.engine.penalties import apply_penalties
from agent_infer.engine.sequence import Sequence
from agent_infer.errors import InvalidRequestError


def _seq(prompt: list[int], output: list[int], **params: Any) -> Sequence:
    seq = Sequence("r", prompt, SamplingParams(**params))
    for t in output:
        seq.append_token(t)
    return seq


def test_semantics_on_known_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5, float("-inf")]] * 4)
    seqs = [
        _seq([0], [1, 4], repetition_penalty=2.0),  # prompt and output tokens 0, 1, 4
        _seq([0], [2, 2, 3], frequency_penalty=0.5),  # output only: 2 twice, 3 once
        _seq([0], [2, 2, 3], presence_penalty=0.25),
        _seq([0], [2]),  # no penalty: the row is untouched
    ]
    out = apply_penalties(logits, seqs)
    assert out[0].tolist() == [1.0, -4.0, 1.0, 0.5, float("-inf")]
    assert out[1].tolist() == [2.0, -2.0, 0.0, 0.0, float("-inf")]
    assert out[2].tolist() == [2.0, -2.0, 0.75, 0.25, float("-inf")]
    assert out[3].tolist() == logits[3].tolist()
    assert logits[0, 0] == 2.0  # the input is not modified (logprobs come from it)


def test_no_penalty_returns_the_same_tensor() -> None:
    logits = torch.zeros(1, 8)
    assert apply_penalties(logits, [_seq([1], [2])]) is logits


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("inf")),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
    ],
)
def test_out_of_range_values_name_the_field(field: str, value: float) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


@pytest.mark.parametrize(
    "penalty", [{"frequency_penalty": 1.0}, {"presence_penalty": 1.5}, {"repetition_penalty": 1.5}]
)
def test_penalties_break_a_greedy_loop_on_the_real_model(llm: Any, penalty: dict[str, float]) -> None:
    # Greedy SmolLM2 continues this prompt by repeating one token; each penalty breaks the loop.
    prompt = "one two one two one two one two"
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0]
    penalized = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32, **penalty))[0].outputs[
        0
    ]
    top = Counter(plain.token_ids).most_common(1)[0][1]
    top_penalized = Counter(penalized.token_ids).most_common(1)[0][1]
    assert top >= 10, plain.text
    if "presence_penalty" in penalty:
        # A presence penalty is paid once per token, so once every candidate has appeared a loop may
        # come back (measured: " two one three two two two four two five six four six six ..."); what
        # it does promise is new tokens.
        assert len(set(penalized.token_ids)) >= 2 * len(set(plain.token_ids)), (plain.text, penalized.text)
    else:
        assert top_penalized <= top // 2, (plain.text, penalized.text)


def test_penalties_keep_constraints(llm: Any) -> None:
    # Penalties change which allowed token wins, never what is allowed.
    schema = {
        "type": "object",
        "properties": {"a": {"type": "array", "items": {"enum": ["x", "y"]}}},
        "required": ["a"],
    }
    params = SamplingParams(
        temperature=0.0, max_tokens=64, structured=schema, repetition_penalty=1.8, frequency_penalty=1.0
    )
    out = llm.chat([[{"role": "user", "content": "JSON with a list a of x and y values."}]], params)[
        0
    ].outputs[0]
    if out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text), schema)
    else:
        assert out.finish_reason == "length"
