"""The remote backend: any OpenAI-compatible ``/v1/chat/completions`` server over httpx.

JSON schemas go as ``response_format: {"type": "json_schema", "json_schema": {..., "strict": true}}``;
regex, grammar and choice as vLLM's ``structured_outputs: {"regex" | "grammar" | "choice": ...}``;
tools as ``tools`` / ``tool_choice`` / ``parallel_tool_calls``. Streaming reads server-sent events,
tool-call deltas included. Rate limits, server failures, dropped connections and timeouts are
retried with exponential backoff (:mod:`retry`); an HTTP error that remains becomes the typed error
its code names (:mod:`remote_errors`) or :class:`RemoteError` with the status and body.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

from agent_infer.client.loop_control import LoopControl
from agent_infer.client.loop_control import resolve as resolve_loop_control
from agent_infer.client.remote_errors import typed_remote_error
from agent_infer.client.request import (
    ModelRequest,
    ModelResponse,
    StreamChunk,
    Usage,
    arguments_text,
    assistant_message,
)
from agent_infer.client.retry import RETRY_STATUSES, RetryPolicy
from agent_infer.errors import ConfigError, RemoteError, warn_constraint
from agent_infer.tool_formats import ToolCallDelta

_PATH = "/chat/completions"


def _httpx() -> Any:
    try:
        import httpx
    except ImportError:
        raise ConfigError(
            "the remote client needs httpx: pip install 'agent-infer[server]' (or httpx)"
        ) from None
    return httpx


def request_body(model: str, request: ModelRequest, stream: bool) -> dict[str, Any]:
    """The chat-completions JSON body for ``request``."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [_wire_message(m) for m in request.messages],
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_tokens": request.max_tokens,
    }
    if request.seed is not None:
        body["seed"] = request.seed
    if request.stop:
        body["stop"] = list(request.stop)
    explicit_loop = isinstance(request.loop_control, LoopControl)
    if request.close_on_length or (explicit_loop and request.loop_last_attempt):
        # Our server's extension (like vLLM's extra sampling fields); only sent when asked for.
        body["close_on_length"] = True
    if explicit_loop:
        # Our server's (and llama.cpp's) fields; the SDK's default is not sent (see loop_control.py).
        chosen = resolve_loop_control(
            request.loop_control, True, request.loop_escalation, request.retried_on_length
        )
        assert chosen is not None
        body.update(chosen.sampling_fields())
        body["dry_sequence_breakers"] = list(chosen.dry_sequence_breakers)
    c = request.constraint
    if c is not None:
        if c.kind == "json_schema":
            name = getattr(c.model, "__name__", None) or "output"
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": name, "schema": c.value, "strict": True, **dict(c.options)},
            }
        elif c.kind == "choice":
            body["structured_outputs"] = {"choice": list(c.value)}
        elif c.kind == "regex":
            body["structured_outputs"] = {"regex": c.value}
        else:
            body["structured_outputs"] = {"grammar": c.grammar_text}
    if request.tools:
        body["tools"] = [t.to_openai() for t in request.tools]
        choice = request.tool_choice
        if isinstance(choice, Mapping) and "function" not in choice:
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        body["tool_choice"] = choice
        body["parallel_tool_calls"] = request.parallel_tool_calls
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return body


def _wire_message(message: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(message)
    if out.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c.get("id"),
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": arguments_text(c["function"].get("arguments", {})),
                },
            }
            for c in out["tool_calls"]
        ]
    return out


def _usage(data: Any) -> Usage:
    if not isinstance(data, Mapping):
        return Usage(requests=1)
    return Usage(int(data.get("prompt_tokens") or 0), int(data.get("completion_tokens") or 0), 1)


def parse_response(data: Any) -> ModelResponse:
    """A ``chat.completion`` object as a :class:`ModelResponse`."""
    try:
        choice = data["choices"][0]
        message = choice["message"]
        # No arguments at all mean "{}", except in an output cut by max_tokens, where a call that
        # got no further than its name is unfinished (_with_cut_call).
        empty = "" if choice.get("finish_reason") == "length" else "{}"
        calls = [
            {
                "id": c.get("id") or f"call_{i}",
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": arguments_text(c["function"].get("arguments") or empty),
                },
            }
            for i, c in enumerate(message.get("tool_calls") or [])
        ]
        return ModelResponse(
            assistant_message(message.get("content"), calls),
            choice.get("finish_reason") or "stop",
            _usage(data.get("usage")),
        )
    except (KeyError, IndexError, TypeError) as exc:
        raise RemoteError(
            f"the server's reply is not a chat completion ({type(exc).__name__}: {exc})",
            status=200,
            body=json.dumps(data)[:2000] if not isinstance(data, str) else data,
        ) from None


def _with_cut_call(request: ModelRequest, response: ModelResponse) -> ModelResponse:
    """Marks a tool call cut off by ``max_tokens``.

    A server that reports a cut call as far as it got (ours, OpenAI) sends it last, with
    arguments that do not parse: it is dropped from the calls and named as unfinished. Under
    ``tool_choice`` "required" or a named tool the whole output is calls, so running out of
    ``max_tokens`` without any call means one was cut off before its name reached the wire.
    """
    if response.finish_reason != "length":
        return response
    calls = response.tool_calls
    if calls and not _parses(calls[-1]["function"]["arguments"]):
        return dataclasses.replace(
            response,
            message=assistant_message(response.message.get("content"), calls[:-1]),
            unfinished_call=calls[-1]["function"]["name"],
            # The wire has no raw text: what the model wrote of the call is its arguments so far.
            raw_text=response.content + calls[-1]["function"]["arguments"],
        )
    if request.forces_calls and not calls:
        return dataclasses.replace(response, unfinished_call="", raw_text=response.content)
    return response


def _parses(arguments: str) -> bool:
    try:
        json.loads(arguments)
    except ValueError:
        return False
    return True


def parse_event(data: Mapping[str, Any]) -> StreamChunk:
    """One ``chat.completion.chunk`` as a :class:`StreamChunk`; an error event raises."""
    if isinstance(data, Mapping) and data.get("error") is not None:
        # An error after the 200 (the engine failed mid-stream) arrives as an event.
        raise typed_remote_error(200, json.dumps(data))
    usage = _usage(data["usage"]) if data.get("usage") else None
    choices = data.get("choices") or []
    if not choices:
        return StreamChunk(usage=usage)
    choice = choices[0]
    delta = choice.get("delta") or {}
    calls = tuple(
        ToolCallDelta(
            index=int(c.get("index", 0)),
            id=c.get("id"),
            name=(c.get("function") or {}).get("name"),
            arguments=(c.get("function") or {}).get("arguments") or "",
        )
        for c in delta.get("tool_calls") or []
    )
    return StreamChunk(delta.get("content") or "", calls, choice.get("finish_reason"), usage)


class _EventReader:
    """Server-sent-event lines to chunks; ``done`` once the server sends ``[DONE]``."""

    def __init__(self) -> None:
        self.done = False

    def feed(self, line: str) -> list[StreamChunk]:
        """The chunk this line carries (none for comments, event names and blank separators)."""
        if self.done or not line.startswith("data:"):
            return []
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return []
        try:
            return [parse_event(json.loads(data))]
        except json.JSONDecodeError:
            raise RemoteError("the server sent an event that is not JSON", status=200, body=data) from None


def _reply(status: int, body: bytes | str) -> Any:
    """The JSON of a reply; an HTTP error status raises the typed error its code names (the one the
    same mistake raises locally), else :class:`RemoteError` with the body."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    if status >= 400:
        raise typed_remote_error(status, text)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise RemoteError("the server's reply is not JSON", status=200, body=text) from None


def _unreachable(url: str, attempt: int, exc: BaseException) -> RemoteError:
    return RemoteError(f"cannot reach {url} ({attempt + 1} attempt(s))", status=0, body=str(exc))


@contextlib.contextmanager
def _transport_errors(message: str) -> Iterator[None]:
    """Connection failures and timeouts become :class:`RemoteError` (status 0)."""
    httpx = _httpx()
    try:
        yield
    except httpx.HTTPError as exc:
        raise RemoteError(message, status=0, body=str(exc)) from exc


class RemoteBackend:
    """Model calls against an OpenAI-compatible server; sync and async clients are made on first use."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout: float = 600.0,
        retry: RetryPolicy | None = None,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url must start with http:// or https://, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout
        self._retry = retry or RetryPolicy()
        self._sync: Any = None
        self._async: Any = None

    @property
    def _url(self) -> str:
        return self.base_url + _PATH

    def _client(self) -> Any:
        if self._sync is None:
            self._sync = _httpx().Client(headers=self._headers, timeout=self._timeout)
        return self._sync

    def _aclient(self) -> Any:
        if self._async is None:
            self._async = _httpx().AsyncClient(headers=self._headers, timeout=self._timeout)
        return self._async

    def _send(self, body: dict[str, Any], stream: bool) -> Any:
        """POST ``body``, retrying transient failures (:mod:`retry`); the last failure is raised."""
        httpx = _httpx()
        client = self._client()
        for attempt in range(self._retry.attempts):
            last = attempt + 1 == self._retry.attempts
            try:
                r = client.send(client.build_request("POST", self._url, json=body), stream=stream)
            except httpx.TransportError as exc:
                if last:
                    raise _unreachable(self._url, attempt, exc) from exc
                time.sleep(self._retry.wait(attempt))
                continue
            except httpx.HTTPError as exc:  # not transient (too many redirects, a bad URL)
                raise _unreachable(self._url, attempt, exc) from exc
            if r.status_code in RETRY_STATUSES and not last:
                r.close()
                time.sleep(self._retry.wait(attempt, r.headers.get("retry-after")))
                continue
            _warn_ignored(r)
            return r
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _asend(self, body: dict[str, Any], stream: bool) -> Any:
        """Async :meth:`_send`."""
        httpx = _httpx()
        client = self._aclient()
        for attempt in range(self._retry.attempts):
            last = attempt + 1 == self._retry.attempts
            try:
                r = await client.send(client.build_request("POST", self._url, json=body), stream=stream)
            except httpx.TransportError as exc:
                if last:
                    raise _unreachable(self._url, attempt, exc) from exc
                await asyncio.sleep(self._retry.wait(attempt))
                continue
            except httpx.HTTPError as exc:  # not transient (too many redirects, a bad URL)
                raise _unreachable(self._url, attempt, exc) from exc
            if r.status_code in RETRY_STATUSES and not last:
                await r.aclose()
                await asyncio.sleep(self._retry.wait(attempt, r.headers.get("retry-after")))
                continue
            _warn_ignored(r)
            return r
        raise AssertionError("unreachable: the last attempt returns or raises")

    def complete(self, request: ModelRequest) -> ModelResponse:
        """One blocking chat-completions call (transient failures retried)."""
        r = self._send(request_body(self.model, request, False), stream=False)
        return _with_cut_call(request, parse_response(_reply(r.status_code, r.text)))

    def stream(self, request: ModelRequest) -> Iterator[StreamChunk]:
        """A streamed call: one chunk per server event (opening it is retried, not a broken stream)."""
        r = self._send(request_body(self.model, request, True), stream=True)
        try:
            if r.status_code >= 400:
                _reply(r.status_code, r.read())
            events = _EventReader()
            with _transport_errors(f"the stream from {self._url} failed"):
                for line in r.iter_lines():
                    yield from events.feed(line)
                    if events.done:
                        return
        finally:
            r.close()

    async def acomplete(self, request: ModelRequest) -> ModelResponse:
        """Async :meth:`complete`."""
        r = await self._asend(request_body(self.model, request, False), stream=False)
        return _with_cut_call(request, parse_response(_reply(r.status_code, r.text)))

    async def astream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        """Async :meth:`stream`."""
        r = await self._asend(request_body(self.model, request, True), stream=True)
        try:
            if r.status_code >= 400:
                _reply(r.status_code, await r.aread())
            events = _EventReader()
            with _transport_errors(f"the stream from {self._url} failed"):
                async for line in r.aiter_lines():
                    for chunk in events.feed(line):
                        yield chunk
                    if events.done:
                        return
        finally:
            await r.aclose()

    def close(self) -> None:
        """Close the sync HTTP connection pool (the async one closes in :meth:`aclose`)."""
        if self._sync is not None:
            self._sync.close()
            self._sync = None

    async def aclose(self) -> None:
        """Close both connection pools."""
        self.close()
        if self._async is not None:
            await self._async.aclose()
            self._async = None


def _warn_ignored(r: Any) -> None:
    """The server's ``X-Agent-Infer-Warnings`` (what its lowering of the constraint ignored) as a
    :class:`~agent_infer.errors.ConstraintWarning`."""
    header = r.headers.get("x-agent-infer-warnings")
    if header and r.status_code < 400:
        warn_constraint(
            json.loads(header), "the server compiled the constraint with parts ignored", stacklevel=4
        )
