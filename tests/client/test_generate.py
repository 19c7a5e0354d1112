"""Client.generate / generate_stream on the real default model: schemas, choice, regex, retries, errors."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from enum import Enum
from typing import Any

import pytest
from client_support import STORY_PROMPT, Story, check_every_attempt_reported
from pydantic import BaseModel, Field, field_validator

from agent_infer import AsyncClient, Client
from agent_infer.client.partial_json import is_prefix_of, model_to_python
from agent_infer.errors import (
    ConfigError,
    ConstraintWarning,
    EngineError,
    InvalidRequestError,
    UnsupportedSchemaError,
    ValidationRetryError,
)
from agent_infer.grammar import Grammar


@pytest.fixture(scope="module")
def client(make_llm: Callable[..., Any]) -> Client:
    return Client.from_llm(make_llm())


class Species(str, Enum):
    CAT = "cat"
    DOG = "dog"
    BIRD = "bird"


class Address(BaseModel):
    city: str = Field(max_length=30)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=120)
    address: Address
    pets: list[Species] = Field(max_length=3)
    nickname: str | None = Field(default=None, max_length=20)


class Node(BaseModel):
    value: int = Field(ge=0, le=99)
    children: list[Node] = Field(max_length=2)


def test_nested_enum_list_optional(client: Client) -> None:
    person = client.generate("Describe a person who lives in Paris and owns pets, as JSON.", schema=Person)
    assert isinstance(person, Person)
    assert isinstance(person.address, Address) and len(person.address.zip_code) == 5
    assert all(isinstance(p, Species) for p in person.pets)


def test_recursive_model(client: Client) -> None:
    example = '{"value": 1, "children": [{"value": 2, "children": []}, {"value": 3, "children": []}]}'
    tree = client.generate(f"Repeat this tree exactly: {example}", schema=Node, max_tokens=120, max_retries=0)
    assert isinstance(tree, Node)

    def depth(n: Node) -> int:
        return 1 + max((depth(c) for c in n.children), default=0)

    assert depth(tree) >= 1


def test_dict_schema_returns_parsed_json(client: Client) -> None:
    schema = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    }
    value = client.generate("Give some tags.", schema=schema)
    assert isinstance(value, dict) and set(value) == {"tags"}
    assert all(t in ("a", "b") for t in value["tags"])


def test_unknown_format_is_a_constraint_warning(client: Client) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "format": "hex-colour", "maxLength": 8}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    with pytest.warns(ConstraintWarning, match=r"unknown format 'hex-colour' at /properties/colour/format"):
        value = client.generate("Name a colour.", schema=schema, max_tokens=20)
    assert isinstance(value, dict) and set(value) == {"colour"} and len(value["colour"]) <= 8


def test_choice_regex_grammar_and_free_text(client: Client) -> None:
    label = client.generate("Is 'I love this!' positive or negative?", choice=["positive", "negative"])
    assert label in ("positive", "negative")
    phone = client.generate("A phone number:", regex=r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}")
    assert len(phone) == 14 and phone[0] == "(" and phone[9] == "-"
    answer = client.generate("Yes or no?", grammar='root ::= "yes" | "no"')
    assert answer in ("yes", "no")
    ir = client.generate("Count:", grammar=Grammar.from_regex(r"[1-3]{2}"))
    assert len(ir) == 2 and set(ir) <= set("123")
    text = client.generate("Say hi.", max_tokens=8)
    assert isinstance(text, str) and text


class Guess(BaseModel):
    word: str = Field(max_length=12)


def test_validator_retry_then_success(client: Client) -> None:
    seen: list[str] = []

    class Once(BaseModel):
        word: str = Field(max_length=12)

        @field_validator("word")
        @classmethod
        def reject_first(cls, v: str) -> str:
            seen.append(v)
            if len(seen) == 1:
                raise ValueError("try a different word")
            return v

    before = client.usage.requests
    result = client.generate("Say one word.", schema=Once, max_retries=2)
    assert isinstance(result, Once) and len(seen) == 2
    assert client.usage.requests == before + 2  # one re-ask


def test_validation_retry_error_carries_every_attempt(client: Client) -> None:
    check_every_attempt_reported(client)


def test_truncated_output_is_a_validation_failure(client: Client) -> None:
    with pytest.raises(ValidationRetryError, match="cut off"):
        client.generate("Describe a person.", schema=Person, max_tokens=3, max_retries=0)


def test_close_on_length_returns_a_valid_object_within_the_budget(client: Client) -> None:
    prompt = STORY_PROMPT
    with pytest.raises(ValidationRetryError, match="cut off"):
        client.generate(prompt, schema=Story, max_tokens=40, max_retries=0)
    before = client.usage
    story = client.generate(prompt, schema=Story, max_tokens=40, max_retries=0, close_on_length=True)
    assert isinstance(story, Story) and story.tags
    used = client.usage.completion_tokens - before.completion_tokens
    assert 0 < used <= 40 and client.usage.requests == before.requests + 1


def test_errors_name_the_problem(client: Client) -> None:
    class Unenforceable(BaseModel):
        x: list[int] = Field(
            json_schema_extra={"contains": {"type": "integer"}, "maxContains": 2, "prefixItems": [{}]}
        )

    with pytest.raises(UnsupportedSchemaError) as info:
        client.generate("Numbers.", schema=Unenforceable)
    assert info.value.pointer == "/properties/x/contains"
    with pytest.raises(InvalidRequestError) as two:
        client.generate("x", regex="a", choice=["a"])
    assert two.value.field == "regex"
    with pytest.raises(InvalidRequestError, match="choice"):
        client.generate("x", choice="ab")
    with pytest.raises(InvalidRequestError, match="schema"):
        client.generate("x", schema=42)
    with pytest.raises(InvalidRequestError, match="max_retries"):
        client.generate("x", schema=Guess, max_retries=-1)
    with pytest.raises(InvalidRequestError, match="prompt"):
        client.generate("")
    with pytest.raises(InvalidRequestError, match="temperature"):
        client.generate("x", temperature=-1.0)


def test_client_configuration_errors(client: Client) -> None:
    with pytest.raises(ConfigError, match="base_url"):
        Client(api_key="secret")
    with pytest.raises(ConfigError, match="http"):
        Client(base_url="ftp://example.org")
    with pytest.raises(ConfigError, match="local models"):
        Client(base_url="http://127.0.0.1:1/v1", engine=client.backend.engine)  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="unknown engine option"):
        Client(not_an_option=1)
    with pytest.raises(InvalidRequestError, match="tool-call format"):
        Client(engine=client.backend.engine, tool_format="nope")  # type: ignore[union-attr]


def test_stream_partials_are_prefixes_of_the_final(client: Client) -> None:
    items = list(client.generate_stream("Describe a person who lives in Rome, as JSON.", schema=Person))
    final = items[-1]
    assert isinstance(final, Person)
    final_json = final.model_dump(mode="json", exclude_unset=True)
    partials = [model_to_python(p) for p in items[:-1]]
    assert len(partials) > 5
    assert all(is_prefix_of(p, final_json) for p in partials)
    assert all(isinstance(p, Person) for p in items[:-1])


def test_stream_dict_schema_and_text(client: Client) -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
            "s": {"type": "string", "maxLength": 20},
        },
        "required": ["n", "s"],
        "additionalProperties": False,
    }
    items = list(client.generate_stream("Some JSON.", schema=schema, max_tokens=60))
    assert isinstance(items[-1], dict) and all(is_prefix_of(p, items[-1]) for p in items[:-1])
    texts = list(client.generate_stream("Count:", regex=r"[0-9]{6}"))
    assert len(texts[-1]) == 6 and all(texts[-1].startswith(t) for t in texts)


def test_async_client_batches_and_streams(client: Client) -> None:
    aclient = AsyncClient(engine=client.backend.engine)  # type: ignore[union-attr]

    async def main() -> tuple[list[Any], list[Any]]:
        labels = await asyncio.gather(
            *(aclient.generate(f"Review {i}: great product.", choice=["good", "bad"]) for i in range(6))
        )
        streamed = [p async for p in aclient.generate_stream("A pet as JSON.", schema=Guess)]
        return labels, streamed

    labels, streamed = asyncio.run(main())
    assert all(label in ("good", "bad") for label in labels)
    assert isinstance(streamed[-1], Guess)
    before = client.usage.requests
    client.generate("Say hi.", max_tokens=4)
    assert client.usage.requests == before + 1 and client.usage.completion_tokens > 0


def test_stream_closed_early_aborts_the_request(client: Client) -> None:
    stream = client.generate_stream("Tell me a long story.", max_tokens=200)
    first = next(stream)
    assert isinstance(first, str)
    stream.close()  # the engine must forget the request
    backend = client.backend
    assert not backend._sinks  # type: ignore[union-attr]
    assert client.generate("Yes or no?", choice=["yes", "no"]) in ("yes", "no")


def test_close_ends_open_calls_and_the_stepping_thread(make_llm: Callable[..., Any]) -> None:
    own = Client.from_llm(make_llm())
    # Output that cannot end for 2,000 tokens, so the request is still running when close() comes
    # however late the test's thread is scheduled.
    stream = own.generate_stream("Tell me a long story.", regex="[a-z ]{8000}", max_tokens=2000)
    next(stream)
    backend = own.backend
    stepping = backend._thread  # type: ignore[union-attr]
    assert stepping is not None and stepping.is_alive()
    own.close()
    assert not stepping.is_alive()  # no step runs once close() returns
    with pytest.raises(EngineError, match="the client was closed while the model call ran"):
        for _ in stream:  # outputs delivered before close() come first
            pass
    assert own.generate("Yes or no?", choice=["yes", "no"]) in ("yes", "no")  # usable again
