"""The server's ``dry_*`` request fields: they reach the engine, and bad values are 400s naming the field."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from server_harness import LiveServer, server_fixture

from agent_infer.sampling_params import SamplingParams

server = server_fixture()

MESSAGES = [{"role": "user", "content": "Count the word 'go' forty times: go go go"}]
DRY = {
    "dry_multiplier": 0.8,
    "dry_base": 1.75,
    "dry_allowed_length": 2,
    "dry_sequence_breakers": ["\n"],
    "dry_penalty_last_n": 64,
    "dry_skip_whitespace": True,
}


def _chat(server: LiveServer, messages: Any = None, **fields: Any) -> httpx.Response:
    body = {
        "model": server.model,
        "messages": messages or MESSAGES,
        "max_tokens": 40,
        "temperature": 0,
        **fields,
    }
    return httpx.post(server.v1 + "/chat/completions", json=body, timeout=120)


def test_dry_fields_round_trip(server: LiveServer, llm: Any) -> None:
    resp = _chat(server, **DRY)
    assert resp.status_code == 200, resp.text
    served = resp.json()["choices"][0]["message"]["content"]
    local = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=40, **DRY))[0].outputs[0].text
    plain = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    assert served == local
    assert served != plain  # the fields were not dropped on the way


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"dry_multiplier": -1}, "dry_multiplier"),
        ({"dry_base": 0.5}, "dry_base"),
        ({"dry_allowed_length": 0}, "dry_allowed_length"),
        ({"dry_penalty_last_n": -5}, "dry_penalty_last_n"),
        ({"dry_sequence_breakers": [""]}, "dry_sequence_breakers"),
        ({"dry_multiplier": "strong"}, "dry_multiplier"),
        ({"dry_sequence_breakers": "x"}, "dry_sequence_breakers"),
    ],
)
def test_bad_dry_values_are_400s_naming_the_field(
    server: LiveServer, fields: dict[str, Any], param: str
) -> None:
    resp = _chat(server, **fields)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


WORDS = {
    "type": "json_schema",
    "json_schema": {
        "name": "words",
        "schema": {
            "type": "object",
            "properties": {"words": {"type": "string"}},
            "required": ["words"],
            "additionalProperties": False,
        },
    },
}
# A prompt the default model answers with a string that repeats itself ("go, go, go, ...").
REPEAT = [{"role": "user", "content": "Write the word 'go' forty times in the words field."}]
CLOSE = {"value_close_multiplier": 2.0, "value_close_allowed": 2}


def test_value_close_fields_round_trip(server: LiveServer, llm: Any) -> None:
    resp = _chat(server, REPEAT, response_format=WORDS, **CLOSE)
    assert resp.status_code == 200, resp.text
    served = resp.json()["choices"][0]["message"]["content"]
    schema = WORDS["json_schema"]["schema"]  # type: ignore[index]
    local = llm.chat(REPEAT, SamplingParams(temperature=0, max_tokens=40, structured=schema, **CLOSE))
    plain = llm.chat(REPEAT, SamplingParams(temperature=0, max_tokens=40, structured=schema))
    assert served == local[0].outputs[0].text
    assert served != plain[0].outputs[0].text  # the repeating string was closed earlier


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"value_close_multiplier": -1}, "value_close_multiplier"),
        ({"value_close_multiplier": "strong"}, "value_close_multiplier"),
        ({"value_close_allowed": -1}, "value_close_allowed"),
        ({"value_close_budget": 1.5}, "value_close_budget"),
        ({"value_close_budget": "late"}, "value_close_budget"),
        ({"value_close_budget_bias": -1}, "value_close_budget_bias"),
    ],
)
def test_bad_value_close_values_are_400s_naming_the_field(
    server: LiveServer, fields: dict[str, Any], param: str
) -> None:
    resp = _chat(server, **fields)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_value_close_budget_fields_round_trip(server: LiveServer, llm: Any) -> None:
    budget = {"value_close_budget": 0.5, "value_close_budget_bias": 8.0}
    resp = _chat(server, REPEAT, response_format=WORDS, **budget)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    schema = WORDS["json_schema"]["schema"]  # type: ignore[index]
    local = llm.chat(REPEAT, SamplingParams(temperature=0, max_tokens=40, structured=schema, **budget))
    plain = llm.chat(REPEAT, SamplingParams(temperature=0, max_tokens=40, structured=schema))
    assert choice["message"]["content"] == local[0].outputs[0].text
    assert plain[0].outputs[0].finish_reason == "length"
    assert choice["finish_reason"] == "stop"  # the string was closed inside the budget


def test_numbers_option_of_json_schema(server: LiveServer) -> None:
    exact = {"type": "json_schema", "json_schema": {**WORDS["json_schema"], "numbers": "exact"}}  # type: ignore[dict-item]
    assert _chat(server, response_format=exact).status_code == 200
    bad = {"type": "json_schema", "json_schema": {**WORDS["json_schema"], "numbers": "double"}}  # type: ignore[dict-item]
    assert _chat(server, response_format=bad).status_code == 400
