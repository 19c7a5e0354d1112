"""``schema=Iterable[Item]``: a list of validated items, streamed one item at a time as each closes.

On the real default model, locally and through a real server on loopback.
"""

from __future__ import annotations

import asyncio
import typing
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
from pydantic import BaseModel, Field, field_validator
from server_harness import LiveServer, server_fixture

from agent_infer import AsyncClient, Client
from agent_infer.client import Hooks, ParseErrorEvent
from agent_infer.errors import InvalidRequestError, ValidationRetryError

server = server_fixture()

PROMPT = "List three fruits with their colours as JSON."


class Fruit(BaseModel):
    name: str = Field(max_length=12)
    colour: str = Field(max_length=10)


# A bounded array keeps the small model's output inside max_tokens.
Fruits = Iterable[Fruit]


@pytest.fixture(scope="module")
def client(make_llm: Callable[..., Any]) -> Client:
    return Client.from_llm(make_llm())


@pytest.fixture(scope="module")
def remote(server: LiveServer) -> Iterator[Client]:
    with Client(base_url=server.v1, model=server.model, api_key="unused") as c:
        yield c


def test_generate_returns_a_list_of_validated_items(client: Client) -> None:
    items = client.generate(PROMPT, schema=Fruits, max_tokens=120, close_on_length=True)
    assert isinstance(items, list) and all(isinstance(f, Fruit) for f in items)
    typed = client.generate(PROMPT, schema=typing.Iterable[Fruit], max_tokens=120, close_on_length=True)
    assert typed == items


class Stamped(BaseModel):
    name: str = Field(max_length=12)

    @field_validator("name")
    @classmethod
    def stamp(cls, value: str) -> str:
        return f"checked:{value}"


def test_items_are_validated_before_generate_returns(client: Client) -> None:
    items = client.generate(PROMPT, schema=Iterable[Stamped], max_tokens=120, close_on_length=True)
    assert isinstance(items, list) and all(s.name.startswith("checked:") for s in items)


def _check_stream(items: list[Any], whole: list[Fruit]) -> None:
    assert all(isinstance(f, Fruit) for f in items)
    assert items == whole  # each item once, in order, the same as the whole list


def test_stream_yields_each_item_as_it_closes(client: Client) -> None:
    whole = client.generate(PROMPT, schema=Fruits, max_tokens=120, close_on_length=True)
    assert len(whole) >= 2, "the prompt should give several items"
    answered: list[Any] = []
    stream = client.generate_stream(
        PROMPT, schema=Fruits, max_tokens=120, close_on_length=True, hooks=Hooks(on_response=answered.append)
    )
    first = next(stream)
    # The first item arrives while the rest of the array is still being generated: the model call
    # has not answered yet (on_response fires when the stream ends).
    assert isinstance(first, Fruit) and first == whole[0] and not answered
    _check_stream([first, *stream], whole)
    assert len(answered) == 1


def test_async_stream_and_generate(client: Client) -> None:
    aclient = AsyncClient(engine=client.backend.engine)  # type: ignore[union-attr]
    whole = client.generate(PROMPT, schema=Fruits, max_tokens=120, close_on_length=True)

    async def both() -> tuple[list[Any], list[Any]]:
        got = await aclient.generate(PROMPT, schema=Fruits, max_tokens=120, close_on_length=True)
        streamed = [
            x
            async for x in aclient.generate_stream(
                PROMPT, schema=Fruits, max_tokens=120, close_on_length=True
            )
        ]
        return got, streamed

    got, streamed = asyncio.run(both())
    assert got == whole
    _check_stream(streamed, whole)


def test_remote_generate_and_stream(remote: Client) -> None:
    whole = remote.generate(PROMPT, schema=Fruits, max_tokens=120, close_on_length=True)
    assert isinstance(whole, list) and all(isinstance(f, Fruit) for f in whole)
    _check_stream(
        list(remote.generate_stream(PROMPT, schema=Fruits, max_tokens=120, close_on_length=True)), whole
    )


class Refused(BaseModel):
    name: str = Field(max_length=12)

    @field_validator("name")
    @classmethod
    def refuse(cls, value: str) -> str:
        raise ValueError("no fruit allowed")


def test_an_invalid_streamed_item_raises_before_it_is_yielded(client: Client) -> None:
    errors: list[ParseErrorEvent] = []
    stream = client.generate_stream(
        PROMPT,
        schema=Iterable[Refused],
        max_tokens=120,
        close_on_length=True,
        hooks=Hooks(on_parse_error=errors.append),
    )
    with pytest.raises(ValidationRetryError, match="not valid") as info:
        list(stream)
    assert "item 0" in info.value.errors[0] and "no fruit allowed" in info.value.errors[0]
    assert len(errors) == 1


def test_iterable_without_an_item_type_is_a_typed_error(client: Client) -> None:
    with pytest.raises(InvalidRequestError, match=r"Iterable\[...\] needs one item type") as info:
        client.generate(PROMPT, schema=Iterable, max_tokens=10)
    assert info.value.field == "schema"
