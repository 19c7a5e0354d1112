"""``n > 1``: several choices per request, whole and streamed, chat and text, with tools."""

from __future__ import annotations

import json
from typing import Any

import pytest
from server_harness import LiveServer, openai_client, server_fixture

openai = pytest.importorskip("openai")

server = server_fixture()

ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    return openai_client(server)


def test_chat_returns_n_choices(client: Any, server: LiveServer) -> None:
    resp = client.chat.completions.create(
        model=server.model, messages=ASK, n=3, max_tokens=6, temperature=1.0, seed=7
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.message.content for c in resp.choices)
    assert len({c.message.content for c in resp.choices}) > 1  # each choice samples on its own
    # One prompt, counted once; every choice's tokens counted.
    assert resp.usage.completion_tokens <= 18 and resp.usage.completion_tokens >= 3
    again = client.chat.completions.create(
        model=server.model, messages=ASK, n=3, max_tokens=6, temperature=1.0, seed=7
    )
    assert [c.message.content for c in again.choices] == [c.message.content for c in resp.choices]


def test_streamed_choices_match_whole_ones(client: Any, server: LiveServer) -> None:
    kw: dict[str, Any] = {
        "model": server.model,
        "messages": ASK,
        "n": 2,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 3,
    }
    whole = client.chat.completions.create(**kw)
    texts = {0: "", 1: ""}
    finishes: dict[int, list[str]] = {0: [], 1: []}
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert all(len(f) == 1 for f in finishes.values())
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_text_completion_choices(client: Any, server: LiveServer) -> None:
    resp = client.completions.create(
        model=server.model, prompt="The sky is", n=2, max_tokens=4, temperature=0
    )
    assert [c.index for c in resp.choices] == [0, 1]
    # Greedy choices are identical, as in vLLM.
    assert resp.choices[0].text == resp.choices[1].text


def test_each_choice_parses_its_own_tool_calls(client: Any, server: LiveServer) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    kw: dict[str, Any] = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [tool],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "n": 2,
        "max_tokens": 40,
        "temperature": 0,
    }
    whole = client.chat.completions.create(**kw)
    for choice in whole.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    calls: dict[int, dict[int, str]] = {0: {}, 1: {}}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                calls[choice.index][delta.index] = calls[choice.index].get(delta.index, "") + (
                    delta.function.arguments or ""
                )
    for index, per_choice in calls.items():
        assert list(per_choice) == [0]
        assert json.loads(per_choice[0]) == json.loads(
            whole.choices[index].message.tool_calls[0].function.arguments
        )
