"""``POST /v1/responses`` with the official client: text, json_schema, tools, streaming, continuation."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import BaseModel
from server_harness import LiveServer, openai_client, server_fixture

openai = pytest.importorskip("openai")

server = server_fixture()

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


class Pet(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    return openai_client(server)


def test_text_response(client: Any, server: LiveServer) -> None:
    resp = client.responses.create(model=server.model, input="Say hello.", max_output_tokens=8, temperature=0)
    assert resp.id.startswith("resp_") and resp.object == "response"
    assert resp.output_text and resp.output[0].type == "message"
    assert resp.usage.input_tokens > 0 and 0 < resp.usage.output_tokens <= 8
    assert resp.status in ("completed", "incomplete")
    if resp.status == "incomplete":
        assert resp.incomplete_details.reason == "max_output_tokens"
    assert client.responses.retrieve(resp.id).output_text == resp.output_text


def test_parse_with_json_schema(client: Any, server: LiveServer) -> None:
    resp = client.responses.parse(
        model=server.model,
        input="Invent a pet as JSON with a name and an age.",
        text_format=Pet,
        max_output_tokens=60,
        temperature=0,
    )
    assert resp.status == "completed"
    assert isinstance(resp.output_parsed, Pet)


def test_function_call_and_continuation(client: Any, server: LiveServer) -> None:
    first = client.responses.create(
        model=server.model,
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    second = client.responses.create(
        model=server.model,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"sky": "sunny"}'}],
        max_output_tokens=20,
        temperature=0,
    )
    assert second.previous_response_id == first.id and second.output_text
    # The earlier turn (question, call, result) is in the prompt, tools aside (they are not inherited).
    alone = client.responses.create(
        model=server.model, input="What is the weather in Paris?", max_output_tokens=1
    )
    assert second.usage.input_tokens > alone.usage.input_tokens + 10


def test_stream_events_match_the_whole_response(client: Any, server: LiveServer) -> None:
    kw: dict[str, Any] = {
        "model": server.model,
        "input": "Reply with the single word yes.",
        "max_output_tokens": 60,
        "temperature": 0,
    }
    whole = client.responses.create(**kw)
    kinds = []
    deltas = ""
    with client.responses.stream(**kw) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas += event.delta
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_item.added" in kinds and "response.output_item.done" in kinds
    assert deltas == final.output_text == whole.output_text


def test_stream_cut_by_max_output_tokens_ends_incomplete(client: Any, server: LiveServer) -> None:
    events = list(
        client.responses.create(
            model=server.model, input="Say hello.", max_output_tokens=2, temperature=0, stream=True
        )
    )
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_streamed_function_call(client: Any, server: LiveServer) -> None:
    kw: dict[str, Any] = {
        "model": server.model,
        "input": "What is the weather in Paris?",
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 60,
        "temperature": 0,
    }
    arguments = ""
    with client.responses.stream(**kw) as stream:
        for event in stream:
            if event.type == "response.function_call_arguments.delta":
                arguments += event.delta
        final = stream.get_final_response()
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert json.loads(arguments) == json.loads(call.arguments)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"previous_response_id": "resp_missing"}, "previous_response_id"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"max_output_tokens": 10**9}, "max_output_tokens"),
        ({"temprature": 0}, "temprature"),
        (
            {
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "x",
                        "schema": {"type": "array", "items": {"$dynamicRef": "#m"}},
                    }
                }
            },
            "text.format.schema",
        ),
        (
            {
                "text": {
                    "format": {
                        "type": "json_schema",
                        "name": "x",
                        "schema": {"type": "string", "format": "cidr"},
                        "unknown_formats": "error",
                    }
                }
            },
            "text.format.schema",
        ),
    ],
)
def test_errors_name_the_field(client: Any, server: LiveServer, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.responses.create(model=server.model, input="x", max_output_tokens=4, extra_body=fields)
    assert caught.value.status_code in (400, 404)
    assert caught.value.body["param"] == param, caught.value.body


def test_ignored_format_is_reported_in_the_warnings_header(client: Any, server: LiveServer) -> None:
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "string", "format": "cidr", "maxLength": 4}}
    raw = client.responses.with_raw_response.create(
        model=server.model, input="x", max_output_tokens=8, extra_body={"text": {"format": fmt}}
    )
    assert json.loads(raw.headers["x-agent-infer-warnings"]) == [
        "ignored unknown format 'cidr' at /format: treated as an annotation"
    ]


def test_numbers_policy_reaches_the_constraint() -> None:
    from agent_infer.grammar import GrammarCompiler, GrammarMatcher, TokenizerInfo
    from agent_infer.server.params import build_constraint
    from agent_infer.server.responses import ResponsesRequest, _chat_request

    long = "3.14159265358979323846"  # more digits than a float64 keeps
    compiler = GrammarCompiler(TokenizerInfo.bytes_only(), cache_enabled=False)

    def accepts_long(numbers: str | None) -> bool:
        fmt: dict[str, Any] = {"type": "json_schema", "name": "x", "schema": {"type": "number"}}
        if numbers is not None:
            fmt["numbers"] = numbers
        req = ResponsesRequest.model_validate({"model": "m", "input": "x", "text": {"format": fmt}})
        structured = build_constraint(_chat_request(req, [{"role": "user", "content": "x"}])).structured
        assert structured is not None
        matcher = GrammarMatcher(compiler.compile(structured.to_grammar()))
        return matcher.accept_string(long) and matcher.can_terminate()

    assert accepts_long("exact")
    assert not accepts_long("float64") and not accepts_long(None)


def test_numbers_option_of_text_format(client: Any, server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "numbers": "exact"}
    resp = client.responses.create(
        model=server.model, input="x", max_output_tokens=4, extra_body={"text": {"format": fmt}}
    )
    assert resp.status in ("completed", "incomplete")
    with pytest.raises(openai.APIStatusError) as caught:
        client.responses.create(
            model=server.model,
            input="x",
            max_output_tokens=4,
            extra_body={"text": {"format": {**fmt, "numbers": "double"}}},
        )
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "text.format.numbers", caught.value.body
