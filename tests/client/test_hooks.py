"""Hooks (on request, response, parse error, tool call) and the optional OpenTelemetry spans.

On the real default model, locally and through a real server on loopback.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import pytest
from pydantic import BaseModel, Field, field_validator
from server_harness import LiveServer, server_fixture

from agent_infer import AsyncClient, Client
from agent_infer.client import Hooks, ParseErrorEvent, RequestEvent, ResponseEvent, ToolCallEvent
from agent_infer.client import hooks as hooks_module
from agent_infer.errors import InvalidRequestError, ValidationRetryError

server = server_fixture()

Short = Annotated[str, Field(max_length=20)]


class Recorder:
    """Hooks that record every event, in order."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.hooks = Hooks(
            on_request=self.events.append,
            on_response=self.events.append,
            on_parse_error=self.events.append,
            on_tool_call=self.events.append,
        )

    def kinds(self) -> list[str]:
        return [type(e).__name__ for e in self.events]


@pytest.fixture(scope="module")
def llm(make_llm: Callable[..., Any]) -> Any:
    return make_llm()


@pytest.fixture(scope="module")
def remote(server: LiveServer) -> Iterator[Client]:
    with Client(base_url=server.v1, model=server.model, api_key="unused") as c:
        yield c


class Never(BaseModel):
    word: str = Field(max_length=10)

    @field_validator("word")
    @classmethod
    def refuse(cls, value: str) -> str:
        raise ValueError("never good enough")


def test_client_hooks_see_requests_responses_and_parse_errors(llm: Any) -> None:
    rec = Recorder()
    client = Client(engine=llm.engine, hooks=rec.hooks)
    with pytest.raises(ValidationRetryError):
        client.generate("Say a word.", schema=Never, max_tokens=20, max_retries=1)
    assert rec.kinds() == [
        "RequestEvent",
        "ResponseEvent",
        "ParseErrorEvent",
        "RequestEvent",
        "ResponseEvent",
        "ParseErrorEvent",
    ]
    first, answer, error = rec.events[:3]
    assert isinstance(first, RequestEvent) and first.request.constraint is not None and not first.stream
    assert isinstance(answer, ResponseEvent) and answer.response is not None and answer.usage.requests == 1
    assert isinstance(error, ParseErrorEvent) and error.attempt == 1 and "never good enough" in error.error
    assert error.raw_output == answer.text
    assert rec.events[5].attempt == 2


def test_per_call_hooks_run_after_the_clients(llm: Any) -> None:
    order: list[str] = []
    client = Client(engine=llm.engine, hooks=Hooks(on_request=lambda e: order.append("client")))
    client.generate("Hi.", max_tokens=3, hooks=Hooks(on_request=lambda e: order.append("call")))
    client.generate("Hi.", max_tokens=3)
    assert order == ["client", "call", "client"]


def test_tool_call_hooks_in_run(llm: Any) -> None:
    def shout(text: Short) -> str:
        """Shout a text."""
        return text.upper()

    rec = Recorder()
    client = Client(engine=llm.engine)
    result = client.run(
        "Shout hello.",
        tools=[shout],
        tool_choice={"name": "shout"},
        max_turns=3,
        max_tokens=40,
        hooks=rec.hooks,
    )
    calls = [e for e in rec.events if isinstance(e, ToolCallEvent)]
    assert calls and calls[0].name == "shout" and calls[0].status == "ok" and calls[0].turn == 1
    tool_messages = [m for m in result.transcript if m["role"] == "tool"]
    assert calls[0].result == tool_messages[0]["content"]
    assert sum(isinstance(e, RequestEvent) for e in rec.events) == result.turns


def test_stream_hooks(llm: Any) -> None:
    rec = Recorder()
    client = Client(engine=llm.engine, hooks=rec.hooks)
    items = list(client.generate_stream("Count to three.", max_tokens=8))
    request, response = rec.events
    assert isinstance(request, RequestEvent) and request.stream
    assert isinstance(response, ResponseEvent) and response.response is None
    assert response.text == items[-1] and response.usage.completion_tokens > 0
    rec.events.clear()
    with pytest.raises(ValidationRetryError):
        list(client.generate_stream("Say a word.", schema=Never, max_tokens=20))
    assert rec.kinds() == ["RequestEvent", "ResponseEvent", "ParseErrorEvent"]


def test_async_hooks(llm: Any) -> None:
    rec = Recorder()
    aclient = AsyncClient(engine=llm.engine, hooks=rec.hooks)
    asyncio.run(aclient.generate("Hi.", max_tokens=3))

    async def stream() -> list[Any]:
        return [x async for x in aclient.chat_stream("Hi.", max_tokens=3)]

    asyncio.run(stream())
    assert rec.kinds() == ["RequestEvent", "ResponseEvent", "RequestEvent", "ResponseEvent"]
    assert rec.events[2].stream


def test_remote_hooks(remote: Client) -> None:
    rec = Recorder()
    remote.chat("Hi.", max_tokens=3, hooks=rec.hooks)
    assert rec.kinds() == ["RequestEvent", "ResponseEvent"]
    assert rec.events[1].response.message["role"] == "assistant"


def test_hook_exceptions_propagate(llm: Any) -> None:
    class Stop(Exception):
        pass

    def refuse(event: RequestEvent) -> None:
        raise Stop("no requests today")

    client = Client(engine=llm.engine)
    with pytest.raises(Stop, match="no requests today"):
        client.generate("Hi.", max_tokens=3, hooks=Hooks(on_request=refuse))


def test_bad_hooks_are_typed_errors(llm: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        Hooks(on_request="print")  # type: ignore[arg-type]
    assert info.value.field == "hooks.on_request"
    with pytest.raises(InvalidRequestError) as info:
        Client(engine=llm.engine, hooks={"on_request": print})  # type: ignore[arg-type]
    assert info.value.field == "hooks"
    with pytest.raises(InvalidRequestError):
        Client(engine=llm.engine).generate("Hi.", max_tokens=3, hooks=print)  # type: ignore[arg-type]


def test_without_opentelemetry(llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry makes ``import opentelemetry`` raise ImportError, as when it is not installed.
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    hooks_module._tracer.cache_clear()
    try:
        client = Client(engine=llm.engine)
        assert client.generate("Hi.", max_tokens=3) is not None
        assert list(client.generate_stream("Hi.", max_tokens=3))
        assert hooks_module._tracer() is None
    finally:
        hooks_module._tracer.cache_clear()


@pytest.mark.skipif(importlib.util.find_spec("opentelemetry") is None, reason="opentelemetry not installed")
def test_with_opentelemetry_each_request_is_a_span(llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from contextlib import contextmanager

    from opentelemetry import trace

    class RecordingSpan(trace.NonRecordingSpan):
        def __init__(self, name: str, attributes: Any) -> None:
            super().__init__(trace.INVALID_SPAN_CONTEXT)
            self.name, self.attributes = name, dict(attributes or {})

        def set_attribute(self, key: str, value: Any) -> None:
            self.attributes[key] = value

        def is_recording(self) -> bool:
            return True

    class RecordingTracer(trace.Tracer):
        def __init__(self) -> None:
            self.spans: list[RecordingSpan] = []

        def start_span(self, name: str, *args: Any, attributes: Any = None, **kw: Any) -> RecordingSpan:
            span = RecordingSpan(name, attributes)
            self.spans.append(span)
            return span

        @contextmanager  # type: ignore[override]
        def start_as_current_span(self, name: str, *args: Any, attributes: Any = None, **kw: Any) -> Any:
            span = self.start_span(name, attributes=attributes)
            with trace.use_span(span, end_on_exit=True):
                yield span

    class RecordingProvider(trace.TracerProvider):
        def __init__(self) -> None:
            self.tracer = RecordingTracer()

        def get_tracer(self, *args: Any, **kw: Any) -> RecordingTracer:
            return self.tracer

    provider = RecordingProvider()
    # The API's global provider can be set only once per process; the test must not leave one behind.
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    # A tracer that saw this provider keeps it: start from a fresh one, and leave none behind.
    hooks_module._tracer.cache_clear()
    try:
        current: list[Any] = []
        client = Client(
            engine=llm.engine, hooks=Hooks(on_request=lambda e: current.append(trace.get_current_span()))
        )
        client.generate("Say a word.", schema=Never.model_json_schema(), max_tokens=20)
        list(client.generate_stream("Hi.", max_tokens=3))
    finally:
        hooks_module._tracer.cache_clear()
    spans = provider.tracer.spans
    assert [s.name for s in spans] == ["agent_infer.request"] * 2
    assert spans[0].attributes["agent_infer.constraint"] == "json_schema"
    assert spans[0].attributes["agent_infer.stream"] is False and spans[1].attributes["agent_infer.stream"]
    assert spans[0].attributes["agent_infer.finish_reason"] in ("stop", "length")
    assert spans[1].attributes["agent_infer.completion_tokens"] > 0
    assert not any(isinstance(c, RecordingSpan) for c in current)  # hooks run outside the span
