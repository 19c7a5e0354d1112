"""Tools over the wire: tool_choice modes, tool_calls responses, streamed call deltas, a multi-turn loop."""

from __future__ import annotations

import json
from typing import Any

import pytest
from server_harness import LiveServer, openai_client, server_fixture

openai = pytest.importorskip("openai")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
TOOLS = [WEATHER, ADD]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


server = server_fixture()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    return openai_client(server)


def _create(client: Any, server: LiveServer, messages: list[Any], **kw: Any) -> Any:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 60)
    return client.chat.completions.create(model=server.model, messages=messages, tools=TOOLS, **kw)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_call_returns_tool_calls(client: Any, server: LiveServer, choice: Any) -> None:
    resp = _create(client, server, ASK, tool_choice=choice, parallel_tool_calls=False)
    choice0 = resp.choices[0]
    assert choice0.finish_reason == "tool_calls"
    (call,) = choice0.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in ("get_weather", "add")
    args = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(args) == {"city"} and isinstance(args["city"], str)
    else:
        assert isinstance(args["a"], int) and isinstance(args["b"], int)


def test_named_choice_calls_that_tool(client: Any, server: LiveServer) -> None:
    resp = _create(
        client,
        server,
        [{"role": "user", "content": "What is 2 plus 3?"}],
        tool_choice={"type": "function", "function": {"name": "add"}},
    )
    (call,) = resp.choices[0].message.tool_calls
    assert call.function.name == "add"
    assert set(json.loads(call.function.arguments)) >= {"a", "b"}


def test_tool_choice_none_gives_text(client: Any, server: LiveServer) -> None:
    resp = _create(client, server, ASK, tool_choice="none", max_tokens=30)
    message = resp.choices[0].message
    assert not message.tool_calls
    assert message.content and "<tool_call>" not in message.content
    assert resp.choices[0].finish_reason in ("stop", "length")


def test_streamed_call_deltas_reassemble_to_the_call(client: Any, server: LiveServer) -> None:
    kw: dict[str, Any] = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    whole = _create(client, server, ASK, **kw).choices[0].message.tool_calls[0]
    calls: dict[int, dict[str, str]] = {}
    finishes = []
    fragments = 0
    for chunk in _create(client, server, ASK, stream=True, **kw):
        choice = chunk.choices[0]
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += delta.id or ""
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
            fragments += 1
    assert finishes == ["tool_calls"]
    assert list(calls) == [0] and fragments > 2  # arguments arrive in pieces, not in one final chunk
    assert calls[0]["name"] == whole.function.name
    assert calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["arguments"]) == json.loads(whole.function.arguments)


def test_multi_turn_tool_loop(client: Any, server: LiveServer) -> None:
    messages: list[Any] = list(ASK)
    first = _create(client, server, messages, tool_choice="required", parallel_tool_calls=False)
    assert first.choices[0].finish_reason == "tool_calls"
    message = first.choices[0].message
    messages.append(message)  # the client's own message object, echoed back as-is
    result = json.dumps({"temperature_c": 21, "sky": "sunny"})
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    second = _create(client, server, messages, max_tokens=30)
    # The transcript (call + result) is in the prompt: it is longer than the first prompt plus the result.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls
    for call in answer.message.tool_calls or []:
        json.loads(call.function.arguments)
    # A third turn with the tool result and tools gone still renders (tool messages need no tools).
    third = client.chat.completions.create(model=server.model, messages=messages, max_tokens=8, temperature=0)
    assert third.choices[0].message.content is not None


GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "GetWeather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city", "unit"],
        },
    },
}


def _streamed(client: Any, server: LiveServer, **kw: Any) -> tuple[str, dict[int, dict[str, str]], list[str]]:
    content = ""
    calls: dict[int, dict[str, str]] = {}
    finishes = []
    for chunk in client.chat.completions.create(model=server.model, stream=True, **kw):
        choice = chunk.choices[0]
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            entry["id"] += delta.id or ""
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    return content, calls, finishes


@pytest.mark.parametrize("max_tokens", [3, 8, 14, 20, 26, 30, 33])
def test_call_cut_by_max_tokens_stays_out_of_content(
    client: Any, server: LiveServer, max_tokens: int
) -> None:
    # max_tokens cuts the call at different places: in the opening tag, the name, the arguments,
    # the closing tag. The half call is never content, and streaming tells the same story.
    kw: dict[str, Any] = {
        "messages": [{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
        "tools": [GET_WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    whole = client.chat.completions.create(model=server.model, **kw).choices[0]
    assert whole.finish_reason == "length"
    assert not whole.message.content, whole.message.content
    whole_calls = whole.message.tool_calls or []
    assert len(whole_calls) <= 1
    for call in whole_calls:
        assert call.function.name == "GetWeather" and call.id.startswith("call_")
    content, calls, finishes = _streamed(client, server, **kw)
    assert finishes == ["length"]
    assert content == ""
    assert len(calls) == len(whole_calls)
    for index, call in enumerate(whole_calls):
        assert calls[index]["name"] == call.function.name
        assert calls[index]["arguments"] == call.function.arguments


def test_streamed_arguments_are_the_non_streamed_arguments_text(client: Any, server: LiveServer) -> None:
    # Sampled (seeded) so that the model spaces its JSON its own way: the non-streamed arguments
    # are its text as written, which is what the streamed deltas concatenate to.
    kw: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Add 2 and 3."}],
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        "temperature": 1.0,
        "seed": 1,
        "max_tokens": 40,
    }
    whole = client.chat.completions.create(model=server.model, **kw).choices[0]
    (call,) = whole.message.tool_calls
    _, calls, finishes = _streamed(client, server, **kw)
    streamed = calls[0]["arguments"]
    assert streamed != json.dumps(json.loads(streamed)), "the seed should give non-default spacing"
    assert finishes == [whole.finish_reason] == ["tool_calls"]
    assert calls[0]["name"] == call.function.name == "add"
    assert streamed == call.function.arguments
