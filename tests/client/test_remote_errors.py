"""The same mistake raises the same typed error locally and against an agent-infer server on loopback."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated, Any

import pytest
from pydantic import Field
from server_harness import LiveServer, server_fixture

from agent_infer import Client
from agent_infer.errors import (
    AgentInferError,
    IncompleteToolCallError,
    InvalidRequestError,
    RemoteError,
)

server = server_fixture()


@pytest.fixture(scope="module")
def local(make_llm: Callable[..., Any]) -> Client:
    return Client.from_llm(make_llm())


@pytest.fixture(scope="module")
def remote(server: LiveServer) -> Iterator[Client]:
    with Client(base_url=server.v1, model=server.model) as c:
        yield c


MISTAKES: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    (
        "unsupported keyword",
        {"schema": {"type": "array", "items": {"$dynamicRef": "#meta"}}},
        ("keyword", "pointer"),
    ),
    ("unknown type", {"schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}, ("pointer",)),
    ("dangling $ref", {"schema": {"type": "object", "properties": {"a": {"$ref": "#/nope"}}}}, ("pointer",)),
    ("GBNF syntax", {"grammar": 'root ::= ("a"'}, ("line", "column", "position")),
    ("regex syntax", {"regex": "a("}, ("line", "column", "position")),
    ("unsupported regex", {"regex": "a(?=b)"}, ("position",)),
]


def _raised(client: Client, options: dict[str, Any]) -> AgentInferError:
    with pytest.raises(AgentInferError) as info:
        client.generate("Hi.", max_tokens=4, max_retries=0, **options)
    return info.value


@pytest.mark.parametrize(("what", "options", "attributes"), MISTAKES, ids=[m[0] for m in MISTAKES])
def test_the_same_mistake_raises_the_same_error(
    local: Client, remote: Client, what: str, options: dict[str, Any], attributes: tuple[str, ...]
) -> None:
    here, there = _raised(local, options), _raised(remote, options)
    assert type(there) is type(here), (what, there)
    for name in attributes:
        assert getattr(there, name) == getattr(here, name), (what, name)
    assert there.status == 400 and "error" in there.body  # type: ignore[attr-defined]
    assert isinstance(there.__cause__, RemoteError)


def test_a_request_field_error_names_the_field(remote: Client) -> None:
    with pytest.raises(InvalidRequestError) as info:
        remote.generate("Hi.", max_tokens=10**9)
    assert info.value.field == "max_tokens"


def test_errors_without_a_local_twin_stay_remote_errors(server: LiveServer) -> None:
    with pytest.raises(RemoteError) as info:
        Client(base_url=server.v1, model="no-such-model").generate("hi", max_tokens=4)
    assert type(info.value) is RemoteError and info.value.status == 404


def test_a_cut_off_forced_call_raises_over_the_wire(remote: Client) -> None:
    def note(text: Annotated[str, Field(max_length=200)]) -> str:
        """Save a note."""
        return "saved"

    with pytest.raises(IncompleteToolCallError) as info:
        remote.chat("Save a note describing Paris.", tools=[note], tool_choice="required", max_tokens=12)
    # The server reports the cut call as far as it got, so its name comes across.
    assert info.value.max_tokens == 12 and info.value.tool == "note" and not info.value.tool_calls


def test_an_error_event_inside_a_stream_raises() -> None:
    """An error after the 200 arrives as a ``data: {"error": ...}`` event; it is raised, not skipped."""
    from agent_infer.client.remote import parse_event

    event = {"error": {"message": "generation failed", "type": "server_error", "code": "engine_error"}}
    with pytest.raises(RemoteError, match="generation failed"):
        parse_event(event)


def test_a_tool_schema_mistake_raises_the_same_error(local: Client, remote: Client) -> None:
    spec = {
        "type": "function",
        "function": {
            "name": "tag",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {"tags": {"type": "array", "items": {"$dynamicRef": "#m"}}},
            },
        },
    }
    raised = []
    for client in (local, remote):
        with pytest.raises(AgentInferError) as info:
            client.chat("Tag it.", tools=[spec], tool_choice="required", max_tokens=5)
        raised.append(info.value)
    here, there = raised
    assert type(there) is type(here)
    assert (there.keyword, there.pointer) == (here.keyword, here.pointer)  # type: ignore[attr-defined]
