"""Client.chat with tools and Client.run (the agent loop) on the real default model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, Field

from agent_infer import AsyncClient, Client, tool
from agent_infer.errors import InvalidRequestError, MaxTurnsExceeded, ToolCallError
from agent_infer.tools import Tool, ToolDefinitionError, ToolRetry


@pytest.fixture(scope="module")
def client(make_llm: Callable[..., Any]) -> Client:
    return Client.from_llm(make_llm())


class Filter(BaseModel):
    field: Literal["price", "rating"]
    minimum: int = Field(ge=0, le=1000)


# Bounded strings and numbers: under the grammar every call then ends within max_tokens.
Short = Annotated[str, Field(max_length=30)]
Small = Annotated[int, Field(ge=-1000, le=1000)]


@tool
def get_weather(city: Short, unit: Literal["c", "f"] = "c") -> str:
    """Current weather in a city.

    Args:
        city: City name, e.g. "Paris".
        unit: Temperature unit.
    """
    return f"sunny in {city}"


@tool
def add(a: Small, b: Small) -> int:
    """Add two integers."""
    return a + b


@tool
def search_products(
    query: Short, filters: Annotated[list[Filter], Field(max_length=2)], limit: Small | None = None
) -> list[str]:
    """Search the product catalogue.

    Args:
        query: Search words.
        filters: Constraints on the results.
        limit: Maximum number of results.
    """
    return [query]


TOOLS = [get_weather, add, search_products]

PROMPTS = [
    "What's the weather in Paris?",
    "Add 2 and 40.",
    "Find running shoes under 100 dollars.",
    "Is it raining in Tokyo?",
    "What is 17 plus 25?",
    "Search for laptops rated at least 4.",
    "Weather in New York in fahrenheit please.",
    "Compute 1000 + 1.",
    "Look for cheap headphones.",
    "How hot is it in Cairo?",
    "Sum of 8 and 9?",
    "I need a blue backpack.",
    "Give me the forecast for Berlin.",
    "Please add -5 and 12.",
    "Show me coffee machines with good ratings.",
]


def _check_calls(message: dict[str, Any], names: set[str], single: bool) -> None:
    calls = message.get("tool_calls") or []
    assert calls, message
    assert not single or len(calls) == 1
    by_name = {t.name: t for t in TOOLS}
    for call in calls:
        assert call["type"] == "function" and call["id"]
        name = call["function"]["name"]
        assert name in names
        by_name[name].validate_arguments(call["function"]["arguments"])  # raises if not schema-valid


def test_required_and_named_calls_are_always_valid(client: Client) -> None:
    """30 varied requests in one batch: 15 with tool_choice="required", 15 naming a tool."""
    aclient = AsyncClient(engine=client.backend.engine)  # type: ignore[union-attr]
    named = [t.name for t in TOOLS]

    async def main() -> list[dict[str, Any]]:
        required = [
            aclient.chat(p, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=160)
            for p in PROMPTS
        ]
        forced = [
            aclient.chat(p, tools=TOOLS, tool_choice={"name": named[i % 3]}, max_tokens=160)
            for i, p in enumerate(PROMPTS)
        ]
        return list(await asyncio.gather(*required, *forced))

    messages = asyncio.run(main())
    for message in messages[: len(PROMPTS)]:
        _check_calls(message, set(named), single=True)
    for i, message in enumerate(messages[len(PROMPTS) :]):
        _check_calls(message, {named[i % 3]}, single=True)


def test_auto_and_none(client: Client) -> None:
    message = client.chat("Say hello.", tools=TOOLS, tool_choice="none", max_tokens=20)
    assert message["role"] == "assistant" and "tool_calls" not in message
    assert isinstance(message["content"], str) and "<tool_call>" not in message["content"]
    auto = client.chat("What's the weather in Rome?", tools=TOOLS, max_tokens=80)
    if auto.get("tool_calls"):
        _check_calls(auto, {t.name for t in TOOLS}, single=False)
    else:
        assert auto["content"]


def test_chat_stream_tool_call_deltas_match_chat(client: Client) -> None:
    kwargs: dict[str, Any] = {"tools": TOOLS, "tool_choice": {"name": "get_weather"}, "max_tokens": 60}
    whole = client.chat("Weather in Oslo?", **kwargs)
    chunks = list(client.chat_stream("Weather in Oslo?", **kwargs))
    deltas = [d for c in chunks for d in c.tool_calls]
    assert deltas[0].name == "get_weather" and deltas[0].id
    arguments = "".join(d.arguments for d in deltas)
    assert json.loads(arguments) == json.loads(whole["tool_calls"][0]["function"]["arguments"])
    assert chunks[-1].finish_reason == "tool_calls" and chunks[-1].usage is not None


def test_other_native_format_through_the_client(client: Client) -> None:
    llama = Client(engine=client.backend.engine, tool_format="llama3_json")  # type: ignore[union-attr]
    message = llama.chat("Add 2 and 3.", tools=TOOLS, tool_choice={"name": "add"}, max_tokens=60)
    _check_calls(message, {"add"}, single=True)
    transcript = [
        {"role": "user", "content": "Add 2 and 3."},
        message,
        {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "5"},
    ]
    rendered = llama.backend.format.render_tools(transcript, TOOLS)  # type: ignore[union-attr]
    assert [m["role"] for m in rendered] == ["user", "assistant", "ipython"]


# --- the agent loop --------------------------------------------------------------------------------

CAPITALS = {"france": "Paris", "japan": "Tokyo", "italy": "Rome"}


class Answer(BaseModel):
    answer: str = Field(max_length=40)


def test_run_executes_real_tools_and_ends(client: Client) -> None:
    executed: list[tuple[str, Any]] = []

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression such as "12 * 7".

        Args:
            expression: The arithmetic expression.
        """
        executed.append(("calculator", expression))
        left, op, right = expression.replace("*", " * ").replace("+", " + ").split()[:3]
        return str(int(left) * int(right) if op == "*" else int(left) + int(right))

    def lookup_capital(country: str) -> str:
        """Look up the capital city of a country.

        Args:
            country: Country name, e.g. "France".
        """
        executed.append(("lookup_capital", country))
        return CAPITALS.get(country.lower(), "unknown")

    result = client.run(
        [
            {
                "role": "system",
                "content": "Use the tools to find facts, then give the answer with final_result.",
            },
            {"role": "user", "content": "What is 12 * 7?"},
        ],
        tools=[calculator, lookup_capital],
        schema=Answer,
        max_turns=6,
        parallel_tool_calls=False,
    )
    assert isinstance(result.output, Answer)
    assert executed, "the loop ended without running a tool"
    tool_messages = [m for m in result.transcript if m["role"] == "tool"]
    assert len(tool_messages) >= len(executed)  # a repeated call is answered without running again
    assert result.transcript[-1]["tool_calls"][0]["function"]["name"] == "final_result"
    assert result.usage.requests == result.turns and result.usage.prompt_tokens > 0


def test_repeated_call_runs_once_and_the_next_turn_answers(client: Client) -> None:
    executed: list[str] = []

    def lookup(country: str) -> str:
        """Capital of a country."""
        executed.append(country)
        return CAPITALS.get(country.lower(), "unknown")

    result = client.run("Capital of France?", tools=[lookup], tool_choice={"name": "lookup"}, max_turns=4)
    calls = [c for m in result.transcript for c in m.get("tool_calls") or []]
    assert len(calls) > len(executed) >= 1  # the repeat was answered from the first result
    assert isinstance(result.output, str) and result.transcript[-1]["role"] == "assistant"


def test_run_without_schema_returns_text(client: Client) -> None:
    result = client.run("Say hello.", tools=[add], tool_choice="none", max_turns=2)
    assert isinstance(result.output, str) and result.turns == 1


def test_tool_errors_go_back_to_the_model_and_turns_are_bounded(client: Client) -> None:
    def flaky(x: int) -> int:
        """Always fails."""
        raise ValueError(f"cannot handle {x}")

    with pytest.raises(MaxTurnsExceeded) as info:
        client.run(
            "Use flaky on 3.", tools=[flaky], tool_choice={"name": "flaky"}, max_turns=2, max_tokens=40
        )
    transcript = info.value.transcript
    errors = [m["content"] for m in transcript if m["role"] == "tool"]
    assert len(errors) >= 2 and all(e.startswith("Error: ValueError: cannot handle") for e in errors)
    assert info.value.max_turns == 2


def _run_pinned(client: Client, prompt: str, fn: Callable[..., Any], **options: Any) -> Any:
    """``run`` with every turn made to call ``fn``, one call at a time."""
    return client.run(
        prompt,
        tools=[fn],
        tool_choice={"name": fn.__name__},
        max_tokens=40,
        parallel_tool_calls=False,
        **options,
    )


def test_tool_retry_asks_for_a_corrected_call(client: Client) -> None:
    attempts: list[int] = []

    def pick(n: int) -> str:
        """Pick a number."""
        attempts.append(n)
        if len(attempts) == 1:
            raise ToolRetry("use a different number")
        return "ok"

    with pytest.raises(MaxTurnsExceeded) as info:
        _run_pinned(client, "Pick a number.", pick, max_turns=2)
    contents = [m["content"] for m in info.value.transcript if m["role"] == "tool"]
    assert contents[0].startswith("Retry: use a different number") and contents[1] == "ok"

    def stubborn(n: int) -> str:
        """Never satisfied."""
        raise ToolRetry("no")

    with pytest.raises(ToolCallError) as err:
        _run_pinned(client, "Go.", stubborn, max_turns=5, max_tool_retries=1)
    assert err.value.tool == "stubborn"


def test_async_run_with_async_tool(client: Client) -> None:
    aclient = AsyncClient(engine=client.backend.engine)  # type: ignore[union-attr]
    seen: list[str] = []

    async def lookup(country: str) -> str:
        """Capital of a country."""
        seen.append(country)
        return CAPITALS.get(country.lower(), "unknown")

    async def main() -> Any:
        return await aclient.run(
            "Capital of Italy?", tools=[lookup], tool_choice={"name": "lookup"}, max_turns=1, max_tokens=40
        )

    with pytest.raises(MaxTurnsExceeded) as info:
        asyncio.run(main())
    assert seen and info.value.transcript[-1]["role"] == "tool"


def test_run_argument_errors(client: Client) -> None:
    spec_only = Tool.from_openai({"type": "function", "function": {"name": "remote_only"}})
    with pytest.raises(ToolDefinitionError, match="no Python function"):
        client.run("x", tools=[spec_only])

    def final_result(x: int) -> int:
        """Clashes with the answer tool."""
        return x

    with pytest.raises(ToolDefinitionError, match="reserved"):
        client.run("x", tools=[final_result], schema=Answer)
    with pytest.raises(InvalidRequestError, match="max_turns"):
        client.run("x", tools=[add], max_turns=0)
    with pytest.raises(ToolDefinitionError, match="tool_choice"):
        client.chat("x", tools=[add], tool_choice={"name": "missing"})
