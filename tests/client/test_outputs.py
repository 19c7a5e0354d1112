"""What instructor / pydantic-ai users expect, on the real default model: the completion next to the
value, and output types beyond Pydantic models."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import Enum
from typing import Annotated, Any, Literal, Union

import pytest
from pydantic import BaseModel, Field

from agent_infer import AsyncClient, Client
from agent_infer.client.partial_json import is_prefix_of
from agent_infer.client.request import Completion, UsageLimits
from agent_infer.errors import InvalidRequestError, UsageLimitExceeded
from agent_infer.tools import ToolRetry

Small = Annotated[int, Field(ge=0, le=100)]


@pytest.fixture(scope="module")
def client(make_llm: Callable[..., Any]) -> Client:
    return Client.from_llm(make_llm())


class Color(str, Enum):
    RED = "red"
    GREEN = "green"


class Cat(BaseModel):
    kind: Literal["cat"]
    name: Annotated[str, Field(max_length=10)]


class Dog(BaseModel):
    kind: Literal["dog"]
    barks: bool


def test_generate_with_completion_returns_the_raw_output(client: Client) -> None:
    value, completion = client.generate_with_completion("Describe a cat.", schema=Cat, max_tokens=60)
    assert isinstance(value, Cat) and isinstance(completion, Completion)
    assert Cat.model_validate_json(completion.text) == value
    assert completion.finish_reason == "stop" and completion.attempts == 1
    assert completion.usage.requests == 1 and completion.usage.completion_tokens > 0
    assert completion.message == {"role": "assistant", "content": completion.text}


def test_chat_with_completion_tells_a_cut_answer_from_a_whole_one(client: Client) -> None:
    message, completion = client.chat_with_completion("Tell me about Paris.", max_tokens=5)
    assert completion.finish_reason == "length" and message["content"] == completion.text
    _, whole = client.chat_with_completion("Say hi.", max_tokens=200)
    assert whole.finish_reason == "stop"

    def add(a: Small, b: Small) -> int:
        """Add two integers."""
        return a + b

    called, completion = client.chat_with_completion(
        "Add 2 and 3.", tools=[add], tool_choice="required", max_tokens=60
    )
    assert called["tool_calls"] and completion.finish_reason == "tool_calls"
    assert completion.text.startswith("<tool_call>")


@pytest.mark.parametrize(
    ("schema", "prompt", "check"),
    [
        (Annotated[list[Small], Field(max_length=5)], "Three small numbers:", lambda v: isinstance(v, list)),
        (Literal["yes", "no"], "Is the sky blue?", lambda v: v in ("yes", "no")),
        (Color, "Color of grass?", lambda v: isinstance(v, Color)),
        (Small, "2+2=", lambda v: isinstance(v, int) and 0 <= v <= 100),
        (bool, "Is fire hot?", lambda v: isinstance(v, bool)),
        (Cat | Dog, "Describe a cat.", lambda v: isinstance(v, Cat | Dog)),
        (Union[Cat, Dog], "Describe a dog.", lambda v: isinstance(v, Cat | Dog)),  # noqa: UP007
    ],
    ids=["list", "literal", "enum", "int", "bool", "union", "typing-union"],
)
def test_output_types_beyond_models(
    client: Client, schema: Any, prompt: str, check: Callable[[Any], bool]
) -> None:
    value = client.generate(prompt, schema=schema, max_tokens=60)
    assert check(value), value


def test_stream_and_run_with_a_union_type(client: Client) -> None:
    items = list(client.generate_stream("Describe a cat.", schema=Cat | Dog, max_tokens=60))
    final = items[-1]
    assert isinstance(final, Cat | Dog)
    assert all(is_prefix_of(p, final.model_dump(mode="json")) for p in items[:-1])

    def lookup(name: Annotated[str, Field(max_length=10)]) -> str:
        """Look up a pet."""
        return "a cat named Tom"

    result = client.run("Describe the pet named Tom.", tools=[lookup], schema=Cat | Dog, max_tokens=120)
    assert isinstance(result.output, Cat | Dog)


def test_async_with_completion_and_a_list_type(client: Client) -> None:
    aclient = AsyncClient(engine=client.backend.engine)  # type: ignore[union-attr]

    async def main() -> tuple[Any, Completion]:
        return await aclient.generate_with_completion(
            "Two numbers:", schema=Annotated[list[Small], Field(max_length=3)], max_tokens=40
        )

    value, completion = asyncio.run(main())
    assert isinstance(value, list) and completion.finish_reason == "stop"


def test_a_non_type_schema_is_a_typed_error(client: Client) -> None:
    with pytest.raises(InvalidRequestError) as info:
        client.generate("x", schema=42)
    assert info.value.field == "schema"


# --- usage limits for run ---------------------------------------------------------------------------


def _pinned(client: Client, limits: UsageLimits, ran: list[int]) -> Any:
    def bump(n: Small) -> int:
        """Increase a counter."""
        ran.append(n)
        raise ToolRetry("try again")  # a retried call is not answered from memory: it runs again

    return client.run(
        "Bump 1.", tools=[bump], tool_choice={"name": "bump"}, max_turns=6, max_tokens=40, usage_limits=limits
    )


def test_usage_limits_bound_requests_tokens_and_tool_calls(client: Client) -> None:
    ran: list[int] = []
    with pytest.raises(UsageLimitExceeded) as requests:
        _pinned(client, UsageLimits(max_requests=1), ran)
    assert requests.value.limit == "max_requests" and requests.value.value == 1
    assert requests.value.usage.requests == 1 and len(ran) == 1

    ran.clear()
    with pytest.raises(UsageLimitExceeded) as tokens:
        _pinned(client, UsageLimits(max_total_tokens=50), ran)
    assert tokens.value.limit == "max_total_tokens" and tokens.value.usage.total_tokens > 50
    assert not ran  # the first call already crossed the bound: its tool call did not run

    ran.clear()
    with pytest.raises(UsageLimitExceeded) as calls:
        _pinned(client, UsageLimits(max_tool_calls=1), ran)  # the same call, retried
    assert calls.value.limit == "max_tool_calls" and len(ran) == 1
    assert calls.value.transcript[-1]["role"] == "assistant"


def test_usage_limits_are_checked(client: Client) -> None:
    with pytest.raises(InvalidRequestError) as info:
        UsageLimits(max_requests=0)
    assert info.value.field == "usage_limits.max_requests"
    with pytest.raises(InvalidRequestError) as wrong:
        client.run("x", tools=[], usage_limits={"max_requests": 1})  # type: ignore[arg-type]
    assert wrong.value.field == "usage_limits"
