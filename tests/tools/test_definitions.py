"""Tools from typed Python functions: schemas, docstrings, validation, invocation, OpenAI shape."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from enum import Enum
from typing import Annotated, Literal, Optional

import pytest
from pydantic import BaseModel, Field

from agent_infer.errors import AgentInferError, InvalidRequestError
from agent_infer.grammar.ir import Grammar
from agent_infer.tools import (
    Tool,
    ToolArgumentsError,
    ToolDefinitionError,
    ToolRetry,
    as_tools,
    parse_docstring,
    tool,
)


class Unit(Enum):
    CELSIUS = "celsius"
    FAHRENHEIT = "fahrenheit"


class Location(BaseModel):
    city: str
    country: str = "FR"


def get_weather(
    location: Location,
    unit: Literal["c", "f"] = "c",
    days: Annotated[int, Field(description="How many days.", ge=1, le=7)] = 1,
    note: str | None = None,
    legacy: Optional[int] = None,  # noqa: UP045 -- the pre-3.10 spelling must work too
    tags: list[str] | None = None,
    weights: dict[str, float] | None = None,
    scale: Unit = Unit.CELSIUS,
) -> str:
    """Get the weather forecast.

    Uses the cached service when it can.

    Args:
        location (Location): Where to look.
        unit: Temperature unit,
            Celsius or Fahrenheit.
        days: Ignored here: Field wins.

    Returns:
        A sentence.
    """
    return f"{location.city}:{unit}:{days}"


def test_schema_from_signature_covers_each_type_family() -> None:
    t = Tool.from_function(get_weather)
    p = t.parameters
    props = p["properties"]
    assert p["type"] == "object" and p["additionalProperties"] is False
    assert p["required"] == ["location"]
    assert props["location"]["$ref"] == "#/$defs/Location"
    assert p["$defs"]["Location"]["required"] == ["city"]
    assert p["$defs"]["Location"]["additionalProperties"] is False  # strict: nested objects are closed too
    assert (
        "additionalProperties"
        not in Tool.from_function(get_weather, strict=False).parameters["$defs"]["Location"]
    )
    assert props["unit"] == {
        "enum": ["c", "f"],
        "type": "string",
        "default": "c",
        "description": "Temperature unit, Celsius or Fahrenheit.",
    }
    assert props["days"]["description"] == "How many days." and props["days"]["maximum"] == 7
    assert {"type": "null"} in props["note"]["anyOf"] and {"type": "null"} in props["legacy"]["anyOf"]
    assert {"type": "array", "items": {"type": "string"}} in props["tags"]["anyOf"]
    assert {"type": "object", "additionalProperties": {"type": "number"}} in props["weights"]["anyOf"]
    assert p["$defs"]["Unit"]["enum"] == ["celsius", "fahrenheit"]
    assert props["scale"]["default"] == "celsius"
    assert "title" not in props["unit"] and "title" not in p
    assert t.description == "Get the weather forecast.\n\nUses the cached service when it can."
    Grammar.from_json_schema(p)  # every generated schema must compile in strict mode


def test_property_named_title_survives_title_stripping() -> None:
    def post(title: str, body: str = "") -> None:
        """Post."""

    assert set(Tool.from_function(post).parameters["properties"]) == {"title", "body"}


@pytest.mark.parametrize(
    "doc",
    [
        """Search the web.

        Args:
            query (str): What to search
                for.
            limit: Max results.
        """,
        """Search the web.

        Parameters
        ----------
        query : str
            What to search
            for.
        limit : int, optional
            Max results.

        Returns
        -------
        list
        """,
        """Search the web.

        :param query: What to search
            for.
        :param int limit: Max results.
        :returns: hits
        """,
    ],
    ids=["google", "numpy", "sphinx"],
)
def test_docstring_styles(doc: str) -> None:
    summary, params = parse_docstring(doc)
    assert summary == "Search the web."
    assert params == {"query": "What to search for.", "limit": "Max results."}

    def search(query: str, limit: int = 5) -> list[str]:
        return []

    search.__doc__ = doc
    t = Tool.from_function(search)
    assert t.description == "Search the web."
    assert t.parameters["properties"]["query"]["description"] == "What to search for."
    assert t.parameters["properties"]["limit"] == {
        "type": "integer",
        "default": 5,
        "description": "Max results.",
    }


def test_docstring_edge_cases() -> None:
    numpy_pair = (
        "Sum.\n\nParameters\n----------\nx, y : int\n    Operands.\n\nReturns\n-------\nint\n    The sum.\n"
    )
    assert parse_docstring(numpy_pair) == ("Sum.", {"x": "Operands.", "y": "Operands."})
    # Prose after a section belongs to it, not to the summary shown to the model.
    assert parse_docstring("Do it.\n\nReturns:\n    nothing\n\nTrailing prose.\n") == ("Do it.", {})
    assert parse_docstring(None) == ("", {})


@pytest.mark.parametrize("sig", ["*args: int", "**kwargs: int", "a: int, /"])
def test_unrepresentable_parameters_are_rejected(sig: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"def f({sig}) -> None: pass", namespace)
    with pytest.raises(ToolDefinitionError, match="tool 'f'") as info:
        Tool.from_function(namespace["f"])  # type: ignore[arg-type]
    assert isinstance(info.value, InvalidRequestError) and isinstance(info.value, AgentInferError)


class Opaque:
    """Not a Pydantic type: has no schema."""


def test_parameters_without_json_form_are_rejected() -> None:
    def takes_callback(cb: Callable[[int], int]) -> None:
        pass

    def takes_opaque(x: Opaque) -> None:
        pass

    for func in (takes_callback, takes_opaque):
        with pytest.raises(
            ToolDefinitionError,
            match=f"tool '{func.__name__}': .*(no JSON Schema|unsupported parameter type)",
        ):
            Tool.from_function(func)


def test_decorator_forms() -> None:
    @tool
    def plain(x: int) -> int:
        """Double x."""
        return 2 * x

    @tool()
    def empty_call(x: int) -> int:
        return x

    @tool(name="renamed", description="Custom.", strict=False)
    def original(x: int) -> int:
        return x

    assert isinstance(plain, Tool) and plain.name == "plain" and plain.description == "Double x."
    assert plain(4) == 8  # the decorated function stays callable
    assert empty_call.name == "empty_call" and empty_call.description == ""
    assert (original.name, original.description, original.strict) == ("renamed", "Custom.", False)
    with pytest.raises(ToolDefinitionError, match="invalid tool name"):
        tool(name="has space")(lambda: None)


def test_openai_shape_and_round_trip() -> None:
    t = Tool.from_function(get_weather)
    spec = t.to_openai()
    assert spec == {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": t.description,
            "parameters": t.parameters,
            "strict": True,
        },
    }
    back = Tool.from_openai(spec)
    assert back == t and back.function is None
    ping = Tool.from_openai({"name": "ping"})
    assert ping.parameters["properties"] == {} and ping.strict is False
    with pytest.raises(ToolDefinitionError):
        Tool.from_openai({"type": "retrieval"})
    with pytest.raises(InvalidRequestError, match="no function"):
        back.invoke({"location": {"city": "x"}})


def test_validation_returns_python_values_and_reports_every_error() -> None:
    t = Tool.from_function(get_weather)
    args = t.validate_arguments('{"location": {"city": "Oslo"}, "scale": "fahrenheit"}')
    assert (
        args["location"] == Location(city="Oslo") and args["scale"] is Unit.FAHRENHEIT and args["days"] == 1
    )
    with pytest.raises(ToolArgumentsError) as info:
        t.validate_arguments({"location": {}, "unit": "k", "days": 9, "extra": 1})
    locs = {tuple(e["loc"]) for e in info.value.errors}
    assert locs == {("location", "city"), ("unit",), ("days",), ("extra",)}
    assert info.value.tool == "get_weather" and info.value.field == "arguments"
    with pytest.raises(ToolArgumentsError, match="not valid JSON"):
        t.validate_arguments("{nope")
    with pytest.raises(ToolArgumentsError, match="JSON object"):
        t.validate_arguments("[1]")


def test_spec_only_tools_validate_against_their_schema() -> None:
    t = Tool.from_openai(
        {
            "name": "f",
            "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
        }
    )
    assert t.validate_arguments({"n": 3}) == {"n": 3}
    with pytest.raises(ToolArgumentsError) as info:
        t.validate_arguments({"n": "3"})
    assert info.value.errors and info.value.errors[0]["loc"] == ("n",)


def test_invoke_and_ainvoke() -> None:
    main_thread = threading.get_ident()
    seen: list[int] = []

    @tool
    def blocking(x: int) -> int:
        seen.append(threading.get_ident())
        return x + 1

    @tool
    async def coro(x: int) -> int:
        await asyncio.sleep(0)
        return x * 10

    assert coro.is_async and not blocking.is_async
    assert blocking.invoke({"x": 1}) == 2
    assert coro.invoke('{"x": 2}') == 20  # no loop running: a fresh one is used

    async def main() -> tuple[int, int, int]:
        # Sync code inside a running loop (a notebook, an async handler): the coroutine runs in
        # its own loop on a worker thread instead of failing.
        inside = coro.invoke({"x": 1})
        return inside, await blocking.ainvoke({"x": 5}), await coro.ainvoke({"x": 3})

    assert asyncio.run(main()) == (10, 6, 30)
    assert seen[0] == main_thread and seen[1] != main_thread  # ainvoke ran the sync tool in a thread
    with pytest.raises(ToolArgumentsError):
        blocking.invoke({"x": "nope"})


def test_tool_retry_propagates() -> None:
    @tool
    def picky(x: int) -> int:
        raise ToolRetry("x must be even")

    assert issubclass(ToolRetry, Exception)
    with pytest.raises(ToolRetry, match="even"):
        picky.invoke({"x": 1})


def test_as_tools_normalizes_and_rejects_duplicates() -> None:
    def f(a: int) -> None:
        """F."""

    tools = as_tools([f, Tool.from_function(get_weather), {"type": "function", "function": {"name": "g"}}])
    assert [t.name for t in tools] == ["f", "get_weather", "g"]
    assert as_tools(None) == []
    with pytest.raises(ToolDefinitionError, match="unique"):
        as_tools([f, {"name": "f"}])
    with pytest.raises(ToolDefinitionError):
        as_tools([42])  # type: ignore[list-item]
