"""The client keeps its promises on the real default model: cut-off tool calls are reported, async tools
run from sync code inside an event loop, schema problems name their field, and loose types are flagged."""

from __future__ import annotations

import asyncio
import json
import warnings
from collections.abc import Callable
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field

from agent_infer import AsyncClient, Client
from agent_infer.errors import IncompleteToolCallError, InvalidRequestError, MaxTurnsExceeded
from agent_infer.tool_formats import get_format
from agent_infer.tool_formats.base import ToolCall
from agent_infer.tools import AnyJSONWarning, Tool, ToolDefinitionError

Short = Annotated[str, Field(max_length=30)]
Small = Annotated[int, Field(ge=-1000, le=1000)]


@pytest.fixture(scope="module")
def client(make_llm: Callable[..., Any]) -> Client:
    return Client.from_llm(make_llm())


def get_weather(city: Short) -> str:
    """Current weather in a city."""
    return f"sunny in {city}"


def add(a: Small, b: Small) -> int:
    """Add two integers."""
    return a + b


class Answer(BaseModel):
    text: Short


# --- a tool call cut off by max_tokens --------------------------------------------------------------


@pytest.mark.parametrize("max_tokens", [3, 6, 12, 20])
def test_chat_reports_a_call_cut_off_by_max_tokens(client: Client, max_tokens: int) -> None:
    """Every cut point inside a forced call raises, naming the tool once its name was written."""
    with pytest.raises(IncompleteToolCallError) as info:
        client.chat(
            "Weather in Paris, then add 2 and 3.",
            tools=[get_weather, add],
            tool_choice="required",
            max_tokens=max_tokens,
        )
    err = info.value
    assert err.max_tokens == max_tokens and err.tool_calls == []
    assert err.raw_output.startswith("<tool_call>") or "<tool_call>".startswith(err.raw_output)
    if '"name": "' in err.raw_output and err.raw_output.count('"') >= 4:
        assert err.tool in ("get_weather", "add")
    assert f"max_tokens={max_tokens}" in str(err)


def test_close_on_length_turns_the_cut_call_into_a_complete_one(client: Client) -> None:
    def note(text: Annotated[str, Field(max_length=200)]) -> str:
        """Save a note."""
        return "saved"

    prompt = "Save a note describing Paris in detail."
    # Loop control off: its closing pressure near max_tokens would end the note on its own.
    ask: dict[str, Any] = {
        "tools": [note],
        "tool_choice": "required",
        "max_tokens": 40,
        "loop_control": False,
    }
    with pytest.raises(IncompleteToolCallError) as info:
        client.chat(prompt, **ask)
    assert info.value.tool == "note"
    message = client.chat(prompt, close_on_length=True, **ask)
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "note" and message["content"] is None
    assert json.loads(call["function"]["arguments"])["text"]


def test_chat_stream_finish_reason_is_length_for_a_cut_call(client: Client) -> None:
    chunks = list(
        client.chat_stream("Weather in Paris?", tools=[get_weather], tool_choice="required", max_tokens=8)
    )
    assert chunks[-1].finish_reason == "length"


def test_run_raises_on_a_cut_call_instead_of_looping(client: Client) -> None:
    with pytest.raises(IncompleteToolCallError) as info:
        client.run("Weather in Paris?", tools=[get_weather], schema=Answer, max_tokens=6, max_turns=3)
    assert info.value.max_tokens == 6


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "deepseek_v3", "deepseek_v31"])
def test_parse_cut_off_keeps_complete_calls_and_drops_the_cut_one(name: str) -> None:
    fmt = get_format(name)
    whole = fmt.render_assistant_tool_calls(
        [ToolCall("add", {"a": 1, "b": 2}), ToolCall("get_weather", {"city": "Paris"})]
    )
    cut = whole[: whole.rindex("Paris") + 2]  # inside the second call's arguments
    parsed = fmt.parse_cut_off(cut)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("add", {"a": 1, "b": 2})]
    assert parsed.unfinished_call == "get_weather"
    assert "Pa" not in parsed.content
    inside_name = fmt.parse_cut_off(whole[: whole.rindex("get_weather") + 3])
    assert inside_name.unfinished_call == ""  # a name is only reported once it is whole
    assert [c.name for c in inside_name.tool_calls] == ["add"]
    finished = fmt.parse_cut_off(whole)
    assert finished.unfinished_call is None and len(finished.tool_calls) == 2


# --- an async tool called by the sync client inside a running event loop ------------------------------


def test_async_tool_runs_from_sync_run_inside_an_event_loop(client: Client) -> None:
    seen: list[str] = []

    async def lookup(country: Short) -> str:
        """Capital of a country."""
        await asyncio.sleep(0)
        seen.append(country)
        return "Rome"

    async def handler() -> Any:  # e.g. a FastAPI endpoint or a notebook cell calling the sync client
        return client.run(
            "Capital of Italy?", tools=[lookup], tool_choice={"name": "lookup"}, max_turns=3, max_tokens=40
        )

    result = asyncio.run(handler())
    tool_results = [m["content"] for m in result.transcript if m["role"] == "tool"]
    assert seen and tool_results and all(r == "Rome" for r in tool_results)


# --- schema problems name their field -----------------------------------------------------------------


class Step(BaseModel):
    title: Short
    on_done: Callable[[int], int]


class Plan(BaseModel):
    name: Short
    steps: list[Step]


def test_schema_field_without_json_form_is_named(client: Client) -> None:
    with pytest.raises(InvalidRequestError) as info:
        client.generate("Plan.", schema=Plan, max_tokens=4)
    assert info.value.field == "schema.steps.on_done"
    assert "'steps.on_done'" in str(info.value) and "Plan" in str(info.value)

    def schedule(when: Short, callback: Callable[[], None]) -> None:
        """Schedule a callback."""

    with pytest.raises(ToolDefinitionError) as tool_info:
        Tool.from_function(schedule)
    assert tool_info.value.field == "schedule.callback" and "'callback'" in str(tool_info.value)


# --- the agent loop ---------------------------------------------------------------------------------


def test_max_turns_exceeded_carries_usage(client: Client) -> None:
    def flaky(x: Small) -> int:
        """Always fails."""
        raise ValueError(f"cannot handle {x}")

    with pytest.raises(MaxTurnsExceeded) as info:
        client.run(
            "Use flaky on 3.", tools=[flaky], tool_choice={"name": "flaky"}, max_turns=2, max_tokens=40
        )
    usage = info.value.usage
    assert usage is not None and usage.requests == 2 and usage.prompt_tokens > 0
    assert usage.completion_tokens > 0


def test_repeated_call_result_carries_no_instruction_text(client: Client) -> None:
    def lookup(country: Short) -> str:
        """Capital of a country."""
        return "Paris"

    result = client.run("Capital of France?", tools=[lookup], tool_choice={"name": "lookup"}, max_turns=4)
    calls = [c for m in result.transcript for c in m.get("tool_calls") or []]
    tool_results = [m["content"] for m in result.transcript if m["role"] == "tool"]
    assert len(calls) >= 2 and tool_results == ["Paris"] * len(calls)
    assert "already made this call" not in json.dumps(result.transcript)


# --- loose types ----------------------------------------------------------------------------------------


def test_untyped_parameters_and_object_fields_are_flagged() -> None:
    def note(text, tags: object = None, count: int = 1):  # type: ignore[no-untyped-def]
        """Save a note.

        Args:
            text: The note.
        """

    with pytest.warns(AnyJSONWarning, match=r"tool 'note': /properties/text, /properties/tags"):
        t = Tool.from_function(note)
    props = t.parameters["properties"]
    assert props["text"]["description"] == "The note. Any JSON value."
    assert props["tags"]["description"] == "Any JSON value."
    assert "description" not in props["count"]

    class Loose(BaseModel):
        name: Short
        extra: object
        nested: list[Any]

    with pytest.warns(AnyJSONWarning, match=r"schema Loose: /properties/extra, /properties/nested/items"):
        from agent_infer.client.request import Constraint

        Constraint.from_keywords(schema=Loose)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Tool.from_function(add)  # fully typed: no warning


def test_async_client_reports_a_cut_call_too(client: Client) -> None:
    aclient = AsyncClient(engine=client.backend.engine)  # type: ignore[union-attr]

    async def main() -> Any:
        return await aclient.chat("Add 2 and 3.", tools=[add], tool_choice={"name": "add"}, max_tokens=5)

    with pytest.raises(IncompleteToolCallError):
        asyncio.run(main())
