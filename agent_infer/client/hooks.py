"""Hooks: callbacks the client calls on each model request and response, parse error and tool call.

``Client(hooks=Hooks(on_request=...))`` applies to every call of the client; ``hooks=`` on a
method adds hooks for that call (the client's run first). Each callback gets one small frozen
event object. Hooks are plain synchronous callables on both clients and run in the caller's
thread (tool-call hooks in the thread that drives the flow, not the tool's worker thread). An
exception raised by a hook is not caught: it propagates out of the client method, ending the call.

When ``opentelemetry`` is importable, each model request is also an OpenTelemetry span
(``agent_infer.request``, attributes ``agent_infer.*``) on the current tracer provider; without it
nothing is imported and nothing is traced.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from agent_infer.client.request import ModelRequest, ModelResponse, StreamChunk, Usage
from agent_infer.errors import InvalidRequestError

__all__ = ["HookEvent", "Hooks", "ParseErrorEvent", "RequestEvent", "ResponseEvent", "ToolCallEvent"]


@dataclass(frozen=True)
class RequestEvent:
    """A model call is about to be made (``stream`` when its answer is streamed)."""

    request: ModelRequest
    stream: bool = False


@dataclass(frozen=True)
class ResponseEvent:
    """A model call answered: its ``text``, ``finish_reason`` and ``usage``.

    ``response`` is the whole :class:`ModelResponse` (message and tool calls) for a call that was
    not streamed, and None for a streamed one (its chunks went to the caller as they came).
    """

    request: ModelRequest
    text: str
    finish_reason: str
    usage: Usage
    response: ModelResponse | None = None


@dataclass(frozen=True)
class ParseErrorEvent:
    """An output failed validation: ``error`` is what the model is told, ``attempt`` counts from 1
    (a re-ask follows while retries are left)."""

    raw_output: str
    error: str
    attempt: int


@dataclass(frozen=True)
class ToolCallEvent:
    """``run`` executed a tool call: ``status`` is "ok", "retry" or "error", ``result`` the text the
    model is shown, ``turn`` the model call (from 1) that made it."""

    name: str
    arguments: str
    call_id: str
    status: str
    result: str
    turn: int


Callback = Callable[[Any], Any]
#: What a flow yields to have its driver call the hooks (sent back None).
HookEvent = ParseErrorEvent | ToolCallEvent


@dataclass(frozen=True)
class Hooks:
    """Callbacks, each optional: ``on_request``, ``on_response``, ``on_parse_error``, ``on_tool_call``."""

    on_request: Callable[[RequestEvent], Any] | None = None
    on_response: Callable[[ResponseEvent], Any] | None = None
    on_parse_error: Callable[[ParseErrorEvent], Any] | None = None
    on_tool_call: Callable[[ToolCallEvent], Any] | None = None
    _extra: tuple[Hooks, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        for name in ("on_request", "on_response", "on_parse_error", "on_tool_call"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise InvalidRequestError(
                    f"hooks.{name} must be callable, got {type(value).__name__}", field=f"hooks.{name}"
                )

    def then(self, other: Hooks | None) -> Hooks:
        """These hooks followed by ``other``'s (the client's, then a call's)."""
        return self if other is None else Hooks(_extra=(self, other))

    def _each(self, name: str) -> Iterator[Callback]:
        own = getattr(self, name)
        if own is not None:
            yield own
        for hooks in self._extra:
            yield from hooks._each(name)

    def request(self, event: RequestEvent) -> None:
        """Call every ``on_request``."""
        for fn in self._each("on_request"):
            fn(event)

    def response(self, event: ResponseEvent) -> None:
        """Call every ``on_response``."""
        for fn in self._each("on_response"):
            fn(event)

    def parse_error(self, event: ParseErrorEvent) -> None:
        """Call every ``on_parse_error``."""
        for fn in self._each("on_parse_error"):
            fn(event)

    def tool_call(self, event: ToolCallEvent) -> None:
        """Call every ``on_tool_call``."""
        for fn in self._each("on_tool_call"):
            fn(event)

    def notify(self, event: HookEvent) -> None:
        """Call the hooks of an event a flow yielded."""
        if isinstance(event, ParseErrorEvent):
            self.parse_error(event)
        else:
            self.tool_call(event)


NO_HOOKS = Hooks()


def response_event(request: ModelRequest, response: ModelResponse) -> ResponseEvent:
    """The :class:`ResponseEvent` of a call that was not streamed."""
    text = response.raw_text if response.raw_text is not None else response.content
    return ResponseEvent(request, text, response.finish_reason, response.usage, response)


class StreamSeen:
    """What a streamed answer has shown so far: its text, finish reason and usage (for the hooks)."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self.finish_reason = "stop"
        self.usage = Usage()

    def add(self, chunk: StreamChunk) -> None:
        """Take in one chunk."""
        if chunk.content:
            self._parts.append(chunk.content)
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
        if chunk.usage is not None:
            self.usage = self.usage + chunk.usage

    def event(self, request: ModelRequest) -> ResponseEvent:
        """The :class:`ResponseEvent` of the whole stream."""
        return ResponseEvent(request, "".join(self._parts), self.finish_reason, self.usage)


def check_hooks(hooks: Any, field_name: str = "hooks") -> Hooks | None:
    """``hooks`` as a :class:`Hooks` or None; anything else is an :class:`InvalidRequestError`."""
    if hooks is not None and not isinstance(hooks, Hooks):
        raise InvalidRequestError(
            f"{field_name} must be an agent_infer.client.Hooks, got {type(hooks).__name__}", field=field_name
        )
    return hooks


@functools.cache
def _tracer() -> Any:
    """The client's tracer, or None without ``opentelemetry``; looked up once, since a failed import
    searches the whole path again every time. The tracer follows a provider set later."""
    try:
        from opentelemetry import trace
    except ImportError:
        return None
    return trace.get_tracer("agent_infer.client")


@contextlib.contextmanager
def request_span(request: ModelRequest, stream: bool) -> Iterator[Any]:
    """An OpenTelemetry span around one model call when ``opentelemetry`` is importable, else nothing."""
    tracer = _tracer()
    if tracer is None:
        yield None
        return
    kind = request.constraint.kind if request.constraint is not None else "none"
    attributes: dict[str, Any] = {
        "agent_infer.constraint": kind,
        "agent_infer.tools": len(request.tools),
        "agent_infer.max_tokens": request.max_tokens,
        "agent_infer.stream": stream,
    }
    with tracer.start_as_current_span("agent_infer.request", attributes=attributes) as span:
        yield span


def record_response(span: Any, finish_reason: str, usage: Usage | None) -> None:
    """Put the answer's finish reason and token counts on the request's span (when there is one)."""
    if span is None:
        return
    span.set_attribute("agent_infer.finish_reason", finish_reason)
    if usage is not None:
        span.set_attribute("agent_infer.prompt_tokens", usage.prompt_tokens)
        span.set_attribute("agent_infer.completion_tokens", usage.completion_tokens)
