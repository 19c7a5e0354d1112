"""Dependencies for tools (``RunContext`` / ``run(deps=...)``) and the validation context of ``generate``.

On the real default model, locally and through a real server on loopback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field, ValidationInfo, field_validator
from server_harness import LiveServer, server_fixture

from agent_infer import AsyncClient, Client
from agent_infer.client import RunContext
from agent_infer.client.agent import PendingCall, execute
from agent_infer.client.request import Constraint
from agent_infer.errors import InvalidRequestError, ValidationRetryError
from agent_infer.tools import Tool, ToolDefinitionError

server = server_fixture()

Short = Annotated[str, Field(max_length=20)]


@pytest.fixture(scope="module")
def client(make_llm: Callable[..., Any]) -> Client:
    return Client.from_llm(make_llm())


@pytest.fixture(scope="module")
def remote(server: LiveServer) -> Iterator[Client]:
    with Client(base_url=server.v1, model=server.model, api_key="unused") as c:
        yield c


@dataclass
class Directory:
    """What the tools depend on: a lookup table, and a log of what they were asked."""

    capitals: dict[str, str]
    asked: list[tuple[str, str, int]]


def capital(ctx: RunContext[Directory], country: Short) -> str:
    """Capital of a country.

    Args:
        country: Country name.
    """
    ctx.deps.asked.append((country, ctx.tool_name, ctx.turn))
    return ctx.deps.capitals.get(country.lower(), "unknown")


# --- RunContext on tools ---------------------------------------------------------------------------


def test_context_parameter_is_not_in_the_schema_and_is_passed() -> None:
    t = Tool.from_function(capital)
    assert set(t.parameters["properties"]) == {"country"}
    assert t.parameters["required"] == ["country"]
    deps = Directory({"france": "Paris"}, [])
    ctx = RunContext(deps, "capital", "call_1", 3)
    assert t.invoke('{"country": "France"}', ctx) == "Paris"
    assert deps.asked == [("France", "capital", 3)]
    # The context is never taken from the model's arguments.
    status, text = execute(PendingCall("c", "capital", '{"ctx": 1, "country": "x"}', t, ctx))
    assert status == "error" and "ctx" in text


def test_async_tool_with_context() -> None:
    async def slow_capital(ctx: RunContext[Directory], country: Short) -> str:
        """Capital of a country."""
        await asyncio.sleep(0)
        return ctx.deps.capitals[country.lower()]

    t = Tool.from_function(slow_capital)
    ctx = RunContext(Directory({"peru": "Lima"}, []))
    assert t.invoke({"country": "Peru"}, ctx) == "Lima"
    assert asyncio.run(t.ainvoke({"country": "Peru"}, ctx)) == "Lima"


def test_context_parameter_must_come_first() -> None:
    def late(country: str, ctx: RunContext[Directory]) -> str:
        """Late context."""
        return country

    with pytest.raises(ToolDefinitionError, match="'ctx' must be the first positional parameter"):
        Tool.from_function(late)


def test_run_passes_deps_to_tools(client: Client) -> None:
    deps = Directory({"france": "Paris"}, [])
    result = client.run(
        "Capital of France?",
        tools=[capital],
        tool_choice={"name": "capital"},
        max_turns=3,
        max_tokens=40,
        deps=deps,
    )
    assert deps.asked, "the tool never ran"
    assert all(name == "capital" and turn >= 1 for _, name, turn in deps.asked)
    tool_messages = [m for m in result.transcript if m["role"] == "tool"]
    assert any(m["content"] in ("Paris", "unknown") for m in tool_messages)


def test_async_run_passes_deps_to_tools(client: Client) -> None:
    aclient = AsyncClient(engine=client.backend.engine)  # type: ignore[union-attr]
    deps = Directory({"france": "Paris"}, [])
    asyncio.run(
        aclient.run(
            "Capital of France?",
            tools=[capital],
            tool_choice={"name": "capital"},
            max_turns=3,
            max_tokens=40,
            deps=deps,
        )
    )
    assert deps.asked and deps.asked[0][1] == "capital"


def test_remote_run_passes_deps_to_tools(remote: Client) -> None:
    deps = Directory({"france": "Paris"}, [])
    remote.run(
        "Capital of France?",
        tools=[capital],
        tool_choice={"name": "capital"},
        max_turns=3,
        max_tokens=40,
        deps=deps,
    )
    assert deps.asked and deps.asked[0][1] == "capital"


def test_deps_of_the_wrong_type_is_a_typed_error(client: Client) -> None:
    with pytest.raises(InvalidRequestError, match=r"RunContext\[Directory\] but deps= is dict") as info:
        client.run("Capital of France?", tools=[capital], max_turns=1, deps={"france": "Paris"})
    assert info.value.field == "deps"


# --- validation_context ----------------------------------------------------------------------------


class Word(BaseModel):
    word: str = Field(max_length=12)

    @field_validator("word")
    @classmethod
    def tagged(cls, value: str, info: ValidationInfo) -> str:
        context = info.context or {}
        if context.get("reject"):
            raise ValueError(f"rejected by context: {context['reject']}")
        return f"{context.get('prefix', '')}{value}"


def test_validation_context_reaches_validators(client: Client) -> None:
    word = client.generate("Say a word.", schema=Word, max_tokens=30, validation_context={"prefix": "ctx:"})
    assert isinstance(word, Word) and word.word.startswith("ctx:")
    value, completion = client.generate_with_completion(
        "Say a word.", schema=list[Word], max_tokens=60, validation_context={"prefix": "ctx:"}
    )
    assert all(w.word.startswith("ctx:") for w in value) and completion.attempts == 1


def test_validation_context_rejection_is_retried(client: Client) -> None:
    with pytest.raises(ValidationRetryError) as info:
        client.generate(
            "Say a word.",
            schema=Word,
            max_tokens=30,
            max_retries=1,
            validation_context={"reject": "no words today"},
        )
    assert len(info.value.errors) == 2
    assert all("rejected by context: no words today" in e for e in info.value.errors)


def test_validation_context_in_streams(client: Client) -> None:
    items = list(
        client.generate_stream("Say a word.", schema=Word, max_tokens=30, validation_context={"prefix": "s:"})
    )
    assert items[-1].word.startswith("s:")
    aclient = AsyncClient(engine=client.backend.engine)  # type: ignore[union-attr]

    async def collect() -> list[Any]:
        return [
            x
            async for x in aclient.generate_stream(
                "Say a word.", schema=Word, max_tokens=30, validation_context={"prefix": "a:"}
            )
        ]

    assert asyncio.run(collect())[-1].word.startswith("a:")
    word = asyncio.run(
        aclient.generate("Say a word.", schema=Word, max_tokens=30, validation_context={"prefix": "a:"})
    )
    assert word.word.startswith("a:")


def test_validation_context_remote(remote: Client) -> None:
    word = remote.generate("Say a word.", schema=Word, max_tokens=30, validation_context={"prefix": "r:"})
    assert word.word.startswith("r:")


def test_validation_context_without_validators_is_a_typed_error(client: Client) -> None:
    for keywords in ({"schema": {"type": "string"}}, {"regex": "a+"}, {}):
        with pytest.raises(InvalidRequestError, match="validation_context needs schema=") as info:
            client.generate("Say a word.", validation_context={"x": 1}, **keywords)
        assert info.value.field == "validation_context"


# --- JSON Schema front-end options and run(validation_context=) -----------------------------------

ODD_FORMAT = {"type": "object", "properties": {"w": {"type": "string", "format": "no-such-format"}}}
ODD_KEYWORD = {"type": "object", "properties": {"w": {"type": "string", "odd": 1}}, "required": ["w"]}


def answer_word(word: Short) -> str:
    """Look a word up.

    Args:
        word: The word.
    """
    return "found"


@pytest.mark.parametrize("where", ["client", "remote"])
def test_unknown_schema_parts_refused_on_request(where: str, request: pytest.FixtureRequest) -> None:
    from agent_infer.errors import UnsupportedSchemaError

    c: Client = request.getfixturevalue(where)
    # Ignored by default (annotations), refused when asked, with the pointer, local and remote alike.
    assert isinstance(c.generate("A word.", schema=ODD_FORMAT, max_tokens=30), dict)
    for schema, option in (
        (ODD_FORMAT, {"unknown_formats": "error"}),
        (ODD_KEYWORD, {"unknown_keywords": "error"}),
    ):
        with pytest.raises(UnsupportedSchemaError) as info:
            c.generate("A word.", schema=schema, max_tokens=30, **option)  # type: ignore[arg-type]
        assert "/properties/w" in str(info.value)
        with pytest.raises(UnsupportedSchemaError):
            c.run("A word.", tools=[answer_word], schema=schema, max_turns=1, max_tokens=30, **option)  # type: ignore[arg-type]


def test_schema_options_are_checked(client: Client) -> None:
    with pytest.raises(InvalidRequestError) as info:
        client.generate("A word.", schema=Word, unknown_formats="warn")
    assert info.value.field == "unknown_formats"
    with pytest.raises(InvalidRequestError) as info:
        client.generate("A word.", regex="a+", numbers="exact")
    assert info.value.field == "numbers"


def test_numbers_policy_reaches_the_grammar(client: Client) -> None:
    schema = {
        "type": "object",
        "properties": {"pi": {"type": "number"}},
        "required": ["pi"],
        "additionalProperties": False,
    }
    prompt = "Write pi with 40 decimal places as JSON."
    value, completion = client.generate_with_completion(
        prompt, schema=schema, max_tokens=60, close_on_length=True
    )
    mantissa = completion.text.split(":", 1)[1].strip(" \n}").lstrip("-").split("e")[0].replace(".", "")
    assert len(mantissa.strip("0")) <= 17 and isinstance(value["pi"], float)
    backend = client.backend
    exact = backend._constraint_grammar(Constraint("json_schema", schema, options=(("numbers", "exact"),)))  # type: ignore[union-attr]
    policy = backend._constraint_grammar(Constraint("json_schema", schema))  # type: ignore[union-attr]
    assert str(exact) != str(policy)


class Tagged(BaseModel):
    word: str = Field(max_length=12)

    @field_validator("word")
    @classmethod
    def tagged(cls, value: str, info: ValidationInfo) -> str:
        return f"{(info.context or {}).get('prefix', '')}{value}"


@pytest.mark.parametrize("where", ["client", "remote"])
def test_run_passes_validation_context(where: str, request: pytest.FixtureRequest) -> None:
    c: Client = request.getfixturevalue(where)
    result = c.run(
        "Answer with a word.",
        tools=[answer_word],
        schema=Tagged,
        tool_choice={"name": "final_result"},
        max_turns=1,
        max_tokens=60,
        validation_context={"prefix": "run:"},
    )
    assert result.output.word.startswith("run:")
    with pytest.raises(InvalidRequestError) as info:
        c.run("A word.", tools=[answer_word], max_turns=1, validation_context={"x": 1})
    assert info.value.field == "validation_context"
