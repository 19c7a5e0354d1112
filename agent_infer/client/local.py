"""The local backend: drives an :class:`LLMEngine` in-process for the client.

A background thread steps the engine while any request is open (and ends when none is), so calls from several threads
(or many coroutines of an ``AsyncClient``) share batches. Each request has a *sink*; the stepping
thread hands it every :class:`RequestOutput` of that request. Tools are rendered into the prompt in
the model's native format (``detect_format`` on its chat template) and the output is constrained by
that format's grammar, then parsed back into OpenAI-shaped tool calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import queue
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from agent_infer.client.loop_control import resolve as resolve_loop_control
from agent_infer.client.request import (
    Constraint,
    ModelRequest,
    ModelResponse,
    StreamChunk,
    Usage,
    assistant_message,
)
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.engine.output import RequestOutput
from agent_infer.errors import ClientClosedError, EngineError, warn_constraint
from agent_infer.grammar.ir import Grammar
from agent_infer.sampling_params import SamplingParams
from agent_infer.structured import StructuredOutput
from agent_infer.thread_exit import stop_at_exit
from agent_infer.tool_formats import ContentDelta, ToolCallDelta, ToolCallFormat, detect_format
from agent_infer.tool_formats.base import ParsedOutput

Sink = Callable[[RequestOutput | BaseException], None]
_GRAMMAR_CACHE_SIZE = 64


class LocalBackend:
    """Runs model calls on a local engine; thread-safe, batches concurrent calls together."""

    def __init__(self, engine: LLMEngine, tool_format: ToolCallFormat | None = None) -> None:
        self.engine = engine
        self.format = tool_format or detect_format(engine.tokenizer.chat_template)
        self._lock = threading.Lock()  # guards the engine and the sinks
        self._sinks: dict[str, Sink] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._grammars: OrderedDict[str, Grammar] = OrderedDict()
        self._grammar_lock = threading.Lock()
        self._exiting = False  # set at interpreter exit: no new requests
        stop_at_exit(self)

    # -- the stepping thread --

    def _submit(self, request: ModelRequest, sink: Sink) -> str:
        prompt, params = self._prepare(request)
        with self._lock:
            if self._exiting:
                raise ClientClosedError(_EXITING)
            request_id = f"client-{next(self._ids)}"
            self.engine.add_request(request_id, prompt, params)
            self._sinks[request_id] = sink
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="agent-infer-client", daemon=True)
                self._thread.start()
        return request_id

    def _abort(self, request_id: str) -> None:
        with self._lock:
            if self._sinks.pop(request_id, None) is not None:
                self.engine.abort(request_id)

    def _loop(self) -> None:
        while True:
            deliveries: list[tuple[Sink, RequestOutput | BaseException]] = []
            with self._lock:
                if not self._sinks:
                    # Idle: end the thread (the next submit starts another) so that nothing holds
                    # the engine alive at interpreter exit.
                    self._thread = None
                    return
                try:
                    outputs = self.engine.step()
                    if not outputs and not self.engine.has_unfinished_requests():
                        raise EngineError("the engine lost track of open client requests")
                except BaseException as exc:  # every waiting caller must hear about it, not hang
                    for request_id, sink in self._sinks.items():
                        self.engine.abort(request_id)
                        deliveries.append((sink, exc))
                    self._sinks.clear()
                    outputs = []
                for out in outputs:
                    target = self._sinks.get(out.request_id)
                    if target is None:
                        continue  # aborted by its caller, or not ours
                    if out.finished:
                        del self._sinks[out.request_id]
                    deliveries.append((target, out))
            for sink, item in deliveries:
                # RuntimeError: the caller's event loop is closed and nobody waits for this output.
                with contextlib.suppress(RuntimeError):
                    sink(item)

    # -- requests --

    def _prepare(self, request: ModelRequest) -> tuple[list[dict[str, Any]], SamplingParams]:
        messages: list[dict[str, Any]] = request.messages
        structured: StructuredOutput | None = None
        if request.tools or _has_tool_turns(messages):
            rendered = self.format.render_tools(messages, list(request.tools))
            assert isinstance(rendered, list)  # no template renderer given: messages come back
            messages = rendered
        if request.tools:
            structured = StructuredOutput.grammar(self._tool_grammar(request))
        elif request.constraint is not None:
            structured = StructuredOutput.grammar(self._constraint_grammar(request.constraint))
        loop = resolve_loop_control(
            request.loop_control, structured is not None, request.loop_escalation, request.retried_on_length
        )
        params = SamplingParams(
            temperature=request.temperature,
            top_p=request.top_p,
            max_tokens=request.max_tokens,
            seed=request.seed,
            stop=list(request.stop) if request.stop else None,
            structured=structured,
            close_on_length=request.close_on_length or (request.loop_last_attempt and loop is not None),
            **(loop.sampling_fields() if loop is not None else {}),
        )
        return messages, params

    def _cached(self, key: str, build: Callable[[], Grammar]) -> Grammar:
        """Lowered grammars by key: a tool grammar embeds every tool's schema, worth building once."""
        with self._grammar_lock:
            hit = self._grammars.get(key)
            if hit is not None:
                self._grammars.move_to_end(key)
                return hit
        grammar = build()  # front-end errors (UnsupportedSchemaError, ...) reach the caller as they are
        with self._grammar_lock:
            self._grammars[key] = grammar
            while len(self._grammars) > _GRAMMAR_CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar

    def _constraint_grammar(self, constraint: Constraint) -> Grammar:
        if isinstance(constraint.value, Grammar):
            return constraint.value
        if constraint.kind == "json_schema":
            structured = StructuredOutput.json_schema(
                constraint.model if constraint.is_model else constraint.value, **dict(constraint.options)
            )
        elif constraint.kind == "regex":
            structured = StructuredOutput.regex(constraint.value)
        elif constraint.kind == "choice":
            structured = StructuredOutput.choice(constraint.value)
        else:
            structured = StructuredOutput.ebnf(constraint.value)
        key = json.dumps([constraint.kind, constraint.value, constraint.options], sort_keys=True, default=str)
        return self._cached(key, lambda: _warned(structured.to_grammar()))

    def _tool_grammar(self, request: ModelRequest) -> Grammar:
        tools = list(request.tools)
        key = json.dumps(
            [[t.to_openai() for t in tools], request.tool_choice, request.parallel_tool_calls],
            sort_keys=True,
            default=str,
        )
        return self._cached(
            "tools:" + key,
            lambda: _warned(
                self.format.grammar(
                    tools, tool_choice=request.tool_choice, parallel_tool_calls=request.parallel_tool_calls
                )
            ),
        )

    def _response(self, request: ModelRequest, out: RequestOutput) -> ModelResponse:
        completion = out.outputs[0]
        if completion.finish_reason in ("error", "abort"):
            raise EngineError(
                f"the model call ended with {completion.finish_reason}: {completion.error or ''}"
            )
        usage = Usage(len(out.prompt_token_ids), len(completion.token_ids), 1)
        finish = completion.finish_reason or "stop"
        if not request.tools:
            return ModelResponse(
                assistant_message(completion.text, []), finish, usage, raw_text=completion.text
            )
        if finish == "length":
            # "length" stays the finish reason even with complete calls, and a call cut short is
            # reported apart from the text: it is neither an answer nor a call that can be made.
            parsed = self.format.parse_cut_off(completion.text)
            if parsed.unfinished_call is None and request.forces_calls and parsed.content.strip():
                # A forced choice ("required" or a named tool) allows only calls, so leftover text
                # is the start of a call cut before the scanner could tell (a partial opening tag).
                parsed = ParsedOutput("", parsed.tool_calls, "")
        else:
            parsed = self.format.parse(completion.text)
        calls = [c.to_openai() for c in parsed.tool_calls]
        reason = "tool_calls" if calls and finish == "stop" else finish
        return ModelResponse(
            assistant_message(parsed.content, calls), reason, usage, parsed.unfinished_call, completion.text
        )

    # -- sync API --

    def _outputs(self, request: ModelRequest) -> Iterator[RequestOutput]:
        inbox: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        with _OpenRequest(self, self._submit(request, inbox.put)) as open_request:
            while not open_request.finished:
                yield open_request.accept(inbox.get())

    def complete(self, request: ModelRequest) -> ModelResponse:
        """Run one model call to the end."""
        outputs = list(self._outputs(request))  # ends with the finished output
        return self._response(request, outputs[-1])

    def stream(self, request: ModelRequest) -> Iterator[StreamChunk]:
        """Run one model call, yielding text and tool-call deltas as tokens arrive."""
        splitter = _DeltaSplitter(self, request)
        for out in self._outputs(request):
            yield from splitter.feed(out)

    # -- async API --

    async def _aoutputs(self, request: ModelRequest) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

        def sink(item: RequestOutput | BaseException) -> None:
            loop.call_soon_threadsafe(inbox.put_nowait, item)

        # Tokenizing and lowering a grammar take milliseconds: not on the event loop.
        if self._exiting:  # the loop's executor may already refuse work
            raise ClientClosedError(_EXITING)
        try:
            request_id = await asyncio.to_thread(self._submit, request, sink)
        except RuntimeError as exc:
            if self._exiting and not isinstance(exc, EngineError):
                # The executor refused the submit: exit began after the check above.
                raise ClientClosedError(_EXITING) from exc
            raise
        with _OpenRequest(self, request_id) as open_request:
            while not open_request.finished:
                yield open_request.accept(await inbox.get())

    async def acomplete(self, request: ModelRequest) -> ModelResponse:
        """Async :meth:`complete`: many concurrent calls are batched together by the engine."""
        outputs = [out async for out in self._aoutputs(request)]
        return self._response(request, outputs[-1])

    async def astream(self, request: ModelRequest) -> AsyncIterator[StreamChunk]:
        """Async :meth:`stream`."""
        splitter = _DeltaSplitter(self, request)
        async for out in self._aoutputs(request):
            for chunk in splitter.feed(out):
                yield chunk

    def close(self) -> None:
        """Abort open requests (their callers get a :class:`ClientClosedError`) and wait for the stepping
        thread to end; a later request starts a new one."""
        with self._lock:
            sinks = list(self._sinks.values())
            for request_id in self._sinks:
                self.engine.abort(request_id)
            self._sinks.clear()
            thread = self._thread
        for sink in sinks:
            with contextlib.suppress(RuntimeError):  # the caller's event loop is closed
                sink(ClientClosedError("the client was closed while the model call ran"))
        # Without sinks the thread ends after its current step; past this point no step runs.
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def refuse_for_exit(self) -> None:
        """As interpreter exit begins: new requests raise :class:`ClientClosedError`; requests in
        flight go on (a thread the interpreter still waits for gets its answer). See
        :mod:`agent_infer.thread_exit`."""
        with self._lock:
            self._exiting = True

    def stop_for_exit(self) -> None:
        """At interpreter exit, once only daemon threads are left: refuse new requests, then
        :meth:`close` (see :mod:`agent_infer.thread_exit`)."""
        self.refuse_for_exit()
        self.close()


_EXITING = "the interpreter is exiting: the local client takes no new requests"


class _OpenRequest:
    """One submitted request while its caller reads it: aborted on exit unless it finished."""

    def __init__(self, backend: LocalBackend, request_id: str) -> None:
        self._backend = backend
        self._request_id = request_id
        self.finished = False

    def accept(self, item: RequestOutput | BaseException) -> RequestOutput:
        """The next output from the stepping thread (an engine failure raises :class:`EngineError`)."""
        if isinstance(item, ClientClosedError):
            raise item
        if isinstance(item, BaseException):
            raise EngineError(f"the engine failed: {type(item).__name__}: {item}") from item
        self.finished = item.finished
        return item

    def __enter__(self) -> _OpenRequest:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self.finished:
            self._backend._abort(self._request_id)


class _DeltaSplitter:
    """Turns successive RequestOutputs of one request into StreamChunks (tool calls parsed as they grow)."""

    def __init__(self, backend: LocalBackend, request: ModelRequest) -> None:
        self._backend = backend
        self._request = request
        self._sent = 0
        self._parser = backend.format.stream_parser() if request.tools else None
        # A stop string is cut from the final text after it was generated: hold back what it may cover.
        self._hold = max((len(s) for s in request.stop or ()), default=1) - 1

    def feed(self, out: RequestOutput) -> list[StreamChunk]:
        text = out.text
        upto = len(text) if out.finished else max(self._sent, len(text) - self._hold)
        delta, self._sent = text[self._sent : upto], max(self._sent, upto)
        chunks = self._chunks(delta, out.finished)
        if out.finished:
            final = self._backend._response(self._request, out)
            chunks.append(StreamChunk(finish_reason=final.finish_reason, usage=final.usage))
        return chunks

    def _chunks(self, delta: str, finished: bool) -> list[StreamChunk]:
        if self._parser is None:
            return [StreamChunk(content=delta)] if delta else []
        events = self._parser.feed(delta) if delta else []
        if finished:
            events += self._parser.finish()
        text = "".join(e.text for e in events if isinstance(e, ContentDelta))
        calls = tuple(e for e in events if isinstance(e, ToolCallDelta))
        return [StreamChunk(content=text, tool_calls=calls)] if text or calls else []


def _has_tool_turns(messages: list[dict[str, Any]]) -> bool:
    return any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)


def _warned(grammar: Grammar) -> Grammar:
    """``grammar``, once what its lowering ignored is issued as a :class:`ConstraintWarning` (once
    per lowering: the client keeps lowered grammars)."""
    warn_constraint(grammar.warnings, "constraint compiled with parts ignored", stacklevel=5)
    return grammar
