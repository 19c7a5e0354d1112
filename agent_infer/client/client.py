"""``Client``: structured generation, tool-calling chat and agent runs on a local model or a remote server.

``Client()`` loads the default model on first use; ``Client(model=path)`` any supported local
model; ``Client(base_url=..., api_key=..., model=name)`` an OpenAI-compatible server (transient
failures retried ``http_retries`` times, default 2, with exponential backoff from ``http_backoff``
seconds, default 0.5). The same
methods exist on :class:`~agent_infer.client.async_client.AsyncClient` as coroutines.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agent_infer.client import call
from agent_infer.client.agent import Outcome, RunResult, ToolBatch, execute
from agent_infer.client.base import ClientBase, T
from agent_infer.client.call import Decoding, Flow, FlowStep, StreamCall, ToolLike
from agent_infer.client.hooks import (
    Hooks,
    RequestEvent,
    StreamSeen,
    record_response,
    request_span,
    response_event,
)
from agent_infer.client.loop_control import LoopControlOption
from agent_infer.client.request import (
    Completion,
    Message,
    ModelRequest,
    StreamChunk,
    ToolChoice,
    UsageLimits,
)


class Client(ClientBase):
    """The synchronous client. Methods are thread-safe; concurrent local calls share batches.

    Decoding defaults to greedy (``temperature=0``) and ``max_tokens=512``.
    """

    def _drive(self, flow: Flow[T], hooks: Hooks) -> T:
        """Perform a flow's steps: model requests on the backend, tool batches in threads, hook events."""
        backend = self.backend
        step = FlowStep(flow)
        while not step.done:
            op = step.op
            if isinstance(op, ToolBatch):
                step.send(self._run_tools(op))
            elif isinstance(op, ModelRequest):
                hooks.request(RequestEvent(op))
                with request_span(op, False) as span:
                    response = self._counted(backend.complete(op))
                    record_response(span, response.finish_reason, response.usage)
                hooks.response(response_event(op, response))
                step.send(response)
            else:
                hooks.notify(op)
                step.send(None)
        return step.result()

    def _stream(self, stream_call: StreamCall, hooks: Hooks) -> Iterator[Any]:
        request = stream_call.request
        hooks.request(RequestEvent(request, stream=True))
        seen = StreamSeen()
        with request_span(request, True) as span:
            for chunk in self.backend.stream(request):
                self._count(chunk.usage)
                seen.add(chunk)
                yield from stream_call.feed(chunk, hooks)
            record_response(span, seen.finish_reason, seen.usage)
        hooks.response(seen.event(request))
        yield from stream_call.finish(hooks)

    def generate(
        self,
        prompt_or_messages: str | Sequence[Mapping[str, Any]],
        *,
        schema: Any = None,
        regex: str | None = None,
        grammar: Any = None,
        choice: Sequence[str] | None = None,
        max_retries: int = 2,
        system: str | None = None,
        temperature: float = 0.0,
        max_tokens: int = 512,
        seed: int | None = None,
        loop_control: LoopControlOption = None,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        close_on_length: bool = False,
        validation_context: Any = None,
        unknown_formats: str = "ignore",
        unknown_keywords: str = "ignore",
        numbers: str = "float64",
        hooks: Hooks | None = None,
    ) -> Any:
        """Generate under at most one constraint; returns a validated value.

        ``schema=`` a Pydantic model (-> an instance) or a JSON Schema dict (-> the parsed JSON);
        ``regex=``, ``grammar=`` (GBNF text or a ``Grammar``) or ``choice=`` (-> the text); none
        -> free text. Output that fails validators beyond the schema is re-asked with the error
        appended, at most ``max_retries`` times, then :class:`ValidationRetryError`.
        ``close_on_length=True`` (local engine, or a server of ours): a constrained output that would
        run out of ``max_tokens`` ends with the grammar's shortest completion instead, so it still
        parses (content cut short). ``validation_context`` is passed to the Pydantic validators
        (``model_validate(..., context=...)``, read as ``info.context``); it needs a model or type schema.
        ``loop_control``: None (on for constrained local calls: :data:`STRUCTURED_LOOP_CONTROL`),
        False (off) or a :class:`LoopControl` (DRY penalty settings, also sent to a remote server).
        """
        decoding = Decoding(temperature, max_tokens, seed, top_p, stop, close_on_length, loop_control)
        flow = call.generate_call(
            prompt_or_messages,
            schema,
            regex,
            grammar,
            choice,
            max_retries,
            system,
            decoding,
            False,
            validation_context,
            schema_options=call.schema_options(unknown_formats, unknown_keywords, numbers),
        )
        return self._drive(flow, self._hooks_for(hooks))

    def generate_stream(
        self,
        prompt_or_messages: str | Sequence[Mapping[str, Any]],
        *,
        schema: Any = None,
        regex: str | None = None,
        grammar: Any = None,
        choice: Sequence[str] | None = None,
        system: str | None = None,
        temperature: float = 0.0,
        max_tokens: int = 512,
        seed: int | None = None,
        loop_control: LoopControlOption = None,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        close_on_length: bool = False,
        validation_context: Any = None,
        unknown_formats: str = "ignore",
        unknown_keywords: str = "ignore",
        numbers: str = "float64",
        hooks: Hooks | None = None,
    ) -> Iterator[Any]:
        """Yield partial values as the output grows; the last item is the full validated value.

        With a Pydantic ``schema`` the partials are ``model_construct`` instances holding only the
        fields that have arrived (closed subtrees validated); with a dict schema, plain partial
        JSON values; otherwise the text so far. Every partial is prefix-consistent with the final.
        """
        decoding = Decoding(temperature, max_tokens, seed, top_p, stop, close_on_length, loop_control)
        yield from self._stream(
            call.generate_stream_call(
                prompt_or_messages,
                schema,
                regex,
                grammar,
                choice,
                system,
                decoding,
                validation_context,
                schema_options=call.schema_options(unknown_formats, unknown_keywords, numbers),
            ),
            self._hooks_for(hooks),
        )

    def chat(
        self,
        messages: str | Sequence[Mapping[str, Any]],
        *,
        tools: Iterable[ToolLike] | None = None,
        tool_choice: ToolChoice = "auto",
        parallel_tool_calls: bool = True,
        temperature: float = 0.0,
        max_tokens: int = 512,
        seed: int | None = None,
        loop_control: LoopControlOption = None,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        close_on_length: bool = False,
        hooks: Hooks | None = None,
    ) -> Message:
        """One assistant turn, OpenAI-shaped: ``{"role", "content", "tool_calls"?}``.

        ``tool_choice`` is "auto" (text or calls), "none", "required" (at least one call) or
        ``{"name": tool}`` (exactly that call); locally the model's native format constrains it.
        """
        decoding = Decoding(temperature, max_tokens, seed, top_p, stop, close_on_length, loop_control)
        return self._drive(
            call.chat_call(messages, tools, tool_choice, parallel_tool_calls, decoding),
            self._hooks_for(hooks),
        )

    def generate_with_completion(
        self,
        prompt_or_messages: str | Sequence[Mapping[str, Any]],
        *,
        schema: Any = None,
        regex: str | None = None,
        grammar: Any = None,
        choice: Sequence[str] | None = None,
        max_retries: int = 2,
        system: str | None = None,
        temperature: float = 0.0,
        max_tokens: int = 512,
        seed: int | None = None,
        loop_control: LoopControlOption = None,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        close_on_length: bool = False,
        validation_context: Any = None,
        unknown_formats: str = "ignore",
        unknown_keywords: str = "ignore",
        numbers: str = "float64",
        hooks: Hooks | None = None,
    ) -> tuple[Any, Completion]:
        """:meth:`generate`, also returning the :class:`Completion` behind the value (raw text,
        finish reason, usage of every attempt, number of attempts)."""
        decoding = Decoding(temperature, max_tokens, seed, top_p, stop, close_on_length, loop_control)
        flow = call.generate_call(
            prompt_or_messages,
            schema,
            regex,
            grammar,
            choice,
            max_retries,
            system,
            decoding,
            True,
            validation_context,
            schema_options=call.schema_options(unknown_formats, unknown_keywords, numbers),
        )
        result: tuple[Any, Completion] = self._drive(flow, self._hooks_for(hooks))
        return result

    def chat_with_completion(
        self,
        messages: str | Sequence[Mapping[str, Any]],
        *,
        tools: Iterable[ToolLike] | None = None,
        tool_choice: ToolChoice = "auto",
        parallel_tool_calls: bool = True,
        temperature: float = 0.0,
        max_tokens: int = 512,
        seed: int | None = None,
        loop_control: LoopControlOption = None,
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
        close_on_length: bool = False,
        hooks: Hooks | None = None,
    ) -> tuple[Message, Completion]:
        """:meth:`chat`, also returning the :class:`Completion` (its ``finish_reason`` says whether the
        turn ended on its own, called tools, or ran out of ``max_tokens``)."""
        decoding = Decoding(temperature, max_tokens, seed, top_p, stop, close_on_length, loop_control)
        flow = call.chat_call(messages, tools, tool_choice, parallel_tool_calls, decoding, True)
        result: tuple[Message, Completion] = self._drive(flow, self._hooks_for(hooks))
        return result

    def chat_stream(
        self,
        messages: str | Sequence[Mapping[str, Any]],
        *,
        tools: Iterable[ToolLike] | None = None,
        tool_choice: ToolChoice = "auto",
        parallel_tool_calls: bool = True,
        temperature: float = 0.0,
        max_tokens: int = 512,
        seed: int | None = None,
        loop_control: LoopControlOption = None,
        hooks: Hooks | None = None,
    ) -> Iterator[StreamChunk]:
        """Stream one assistant turn: text deltas and OpenAI-shaped tool-call deltas, then the finish reason."""
        decoding = Decoding(temperature, max_tokens, seed, loop_control=loop_control)
        yield from self._stream(
            call.chat_stream_call(messages, tools, tool_choice, parallel_tool_calls, decoding),
            self._hooks_for(hooks),
        )

    def run(
        self,
        messages: str | Sequence[Mapping[str, Any]],
        *,
        tools: Iterable[ToolLike],
        schema: Any = None,
        max_turns: int = 10,
        tool_choice: ToolChoice | None = None,
        parallel_tool_calls: bool = True,
        max_tool_retries: int = 2,
        temperature: float = 0.0,
        max_tokens: int = 512,
        seed: int | None = None,
        loop_control: LoopControlOption = None,
        usage_limits: UsageLimits | None = None,
        deps: Any = None,
        validation_context: Any = None,
        unknown_formats: str = "ignore",
        unknown_keywords: str = "ignore",
        hooks: Hooks | None = None,
    ) -> RunResult:
        """The agent loop: call the model, execute its tool calls, repeat until a final answer.

        Without ``schema`` the answer is the first reply without tool calls (``tool_choice``
        defaults to "auto"); with one, the model answers by calling ``final_result`` with
        schema-valid arguments (``tool_choice`` defaults to "required"). Tool errors go back to the
        model as text; ``ToolRetry`` asks for a corrected call (at most ``max_tool_retries`` per
        tool, then :class:`ToolCallError`); :class:`MaxTurnsExceeded` after ``max_turns`` calls.
        ``usage_limits`` bounds requests, tokens and tool calls (:class:`UsageLimitExceeded`).
        ``hooks`` (every method) adds :class:`~agent_infer.client.hooks.Hooks` for this call.
        A tool whose first parameter is annotated ``RunContext[Deps]`` is passed a
        :class:`~agent_infer.tools.RunContext` holding ``deps`` (``deps`` must then be a ``Deps``).
        """
        decoding = Decoding(temperature, max_tokens, seed, loop_control=loop_control)
        flow = call.run_call(
            messages,
            tools,
            schema,
            max_turns,
            tool_choice,
            parallel_tool_calls,
            max_tool_retries,
            decoding,
            usage_limits,
            deps,
            validation_context=validation_context,
            schema_options=call.schema_options(unknown_formats, unknown_keywords),
        )
        return self._drive(flow, self._hooks_for(hooks))

    @staticmethod
    def _run_tools(batch: ToolBatch) -> list[Outcome]:
        if not batch.parallel or len(batch.calls) < 2:
            return [execute(call) for call in batch.calls]
        with ThreadPoolExecutor(max_workers=len(batch.calls)) as pool:
            futures = []
            for call in batch.calls:
                try:
                    futures.append(pool.submit(execute, call))
                except RuntimeError:  # the interpreter is exiting: thread pools take no new work
                    break
            outcomes = [future.result() for future in futures]
        # What the pool refused runs here, so a run in flight at exit still executes every call.
        return outcomes + [execute(call) for call in batch.calls[len(futures) :]]

    def close(self) -> None:
        """Abort open local requests / close the HTTP connections."""
        if self._backend is not None:
            self._backend.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
