"""The remote client against a real agent-infer server on loopback: the local scenarios over the wire."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import pytest
from client_support import STORY_PROMPT, Story, check_every_attempt_reported
from pydantic import BaseModel, Field
from server_harness import LiveServer, server_fixture

from agent_infer import AsyncClient, Client
from agent_infer.client.partial_json import is_prefix_of, model_to_python
from agent_infer.errors import ConstraintWarning, GrammarSyntaxError, MaxTurnsExceeded, RemoteError

server = server_fixture()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Iterator[Client]:
    with Client(base_url=server.v1, model=server.model, api_key="unused") as c:
        yield c


class Pet(BaseModel):
    name: str = Field(max_length=20)
    species: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)


Short = Annotated[str, Field(max_length=30)]


def get_weather(city: Short, unit: Literal["c", "f"] = "c") -> str:
    """Current weather in a city."""
    return f"sunny in {city}"


def add(a: Annotated[int, Field(ge=-100, le=100)], b: Annotated[int, Field(ge=-100, le=100)]) -> int:
    """Add two integers."""
    return a + b


def test_generate_schema_choice_regex_grammar(client: Client) -> None:
    assert client.is_remote
    pet = client.generate("Describe a pet as JSON.", schema=Pet)
    assert isinstance(pet, Pet)
    assert client.generate("Is the sky blue?", choice=["yes", "no"]) in ("yes", "no")
    code = client.generate("A code:", regex=r"[A-Z]{2}-[0-9]{3}")
    assert len(code) == 6 and code[2] == "-"
    assert client.generate("y or n", grammar='root ::= "y" | "n"') in ("y", "n")
    assert client.usage.requests == 4 and client.usage.prompt_tokens > 0


def test_server_warnings_are_constraint_warnings(client: Client) -> None:
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "maximum": 99, "mininum": 3}},
        "required": ["n"],
        "additionalProperties": False,
    }
    with pytest.warns(ConstraintWarning, match=r"mininum at /properties/n/mininum.*did you mean 'minimum'"):
        value = client.generate("A number as JSON.", schema=schema, max_tokens=20, close_on_length=True)
    assert isinstance(value, dict) and isinstance(value["n"], int) and value["n"] <= 99


def test_validators_re_ask_over_the_wire(client: Client) -> None:
    check_every_attempt_reported(client)


def test_stream_partials_are_prefixes(client: Client) -> None:
    items = list(client.generate_stream("Describe a pet as JSON.", schema=Pet))
    final = items[-1]
    assert isinstance(final, Pet) and len(items) > 3
    final_json = final.model_dump(mode="json")
    assert all(is_prefix_of(model_to_python(p), final_json) for p in items[:-1])


def test_chat_tools_required_named_and_stream(client: Client) -> None:
    tools = [get_weather, add]
    for prompt in ("Weather in Paris?", "Add 2 and 3.", "Is it cold in Oslo?"):
        message = client.chat(prompt, tools=tools, tool_choice="required", parallel_tool_calls=False)
        (call,) = message["tool_calls"]
        assert call["function"]["name"] in ("get_weather", "add")
        json.loads(call["function"]["arguments"])
    named = client.chat("Add 2 and 3.", tools=tools, tool_choice={"name": "add"})
    args = json.loads(named["tool_calls"][0]["function"]["arguments"])
    assert set(args) == {"a", "b"}
    chunks = list(client.chat_stream("Add 2 and 3.", tools=tools, tool_choice={"name": "add"}))
    deltas = [d for c in chunks for d in c.tool_calls]
    assert deltas[0].name == "add" and deltas[0].id
    assert json.loads("".join(d.arguments for d in deltas)) == args
    assert any(c.finish_reason == "tool_calls" for c in chunks)


def test_run_executes_tools_over_the_wire(client: Client) -> None:
    executed: list[tuple[int, int]] = []

    def adder(a: Annotated[int, Field(ge=-100, le=100)], b: Annotated[int, Field(ge=-100, le=100)]) -> int:
        """Add two integers."""
        executed.append((a, b))
        return a + b

    with pytest.raises(MaxTurnsExceeded) as info:
        client.run("Add 2 and 3.", tools=[adder], tool_choice={"name": "adder"}, max_turns=2)
    results = [m for m in info.value.transcript if m["role"] == "tool"]
    assert executed and len(results) == 2
    assert results[0]["content"] == str(sum(executed[0]))
    done = client.run("Say hi.", tools=[adder], tool_choice="none", max_turns=2)
    assert isinstance(done.output, str) and done.turns == 1


def test_close_on_length_over_the_wire(client: Client) -> None:
    story = client.generate(STORY_PROMPT, schema=Story, max_tokens=40, max_retries=0, close_on_length=True)
    assert isinstance(story, Story) and story.tags


def test_remote_errors(server: LiveServer) -> None:
    with pytest.raises(RemoteError) as wrong_model:
        Client(base_url=server.v1, model="no-such-model").generate("hi", max_tokens=4)
    assert wrong_model.value.status == 404 and "no-such-model" in wrong_model.value.body
    with pytest.raises(GrammarSyntaxError) as bad_regex:  # the local error type, with its position
        Client(base_url=server.v1, model=server.model).generate("hi", regex="(unclosed")
    assert bad_regex.value.status == 400 and bad_regex.value.position == 0  # type: ignore[attr-defined]
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(RemoteError) as unreachable:
        Client(base_url=f"http://127.0.0.1:{port}/v1", model="m").generate("hi")
    assert unreachable.value.status == 0


def test_async_remote(server: LiveServer) -> None:
    async def main() -> tuple[list[Any], Any]:
        async with AsyncClient(base_url=server.v1, model=server.model) as aclient:
            labels = await asyncio.gather(
                *(aclient.generate(f"Review {i}: great.", choice=["good", "bad"]) for i in range(4))
            )
            streamed = [p async for p in aclient.generate_stream("A pet as JSON.", schema=Pet)]
            return list(labels), streamed[-1]

    labels, pet = asyncio.run(main())
    assert all(label in ("good", "bad") for label in labels) and isinstance(pet, Pet)
