"""``Client``: structured generation, tool-calling chat and agent runs on a local model or a remote server.

``Client()`` loads the default model on first use; ``Client(model=path)`` any supported local
model; ``Client(base_url=..., api_key=..., model=name)`` an OpenAI-compatible server (transient
failures retried ``http_retries`` times, default 2, with exponential backoff from ``http_backoff``
seconds, default 0.5). The same
methods exist on :class:`~agent_infer.client.async_client.AsyncClient` as coroutines.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from agent_infer.client import call
from agent_infer.client.agent import Outcome, RunResult, ToolBatch, execute
from agent_infer.client.call import Decoding, Flow, FlowStep, StreamCall, ToolLike
from agent_infer.client.hooks import (
    NO_HOOKS,
    Hooks,
    RequestEvent,
    StreamSeen,
    check_hooks,
    record_response,
    request_span,
    response_event,
)
from agent_infer.client.local import LocalBackend
from agent_infer.client.loop_control import LoopControlOption
from agent_infer.client.remote import RemoteBackend
from agent_infer.client.request import (
    Completion,
    Message,
    ModelRequest,
    ModelResponse,
    StreamChunk,
    ToolChoice,
    Usage,
    UsageLimits,
)
from agent_infer.client.retry import RetryPolicy
from agent_infer.errors import ConfigError

T = TypeVar("T")
Backend = LocalBackend | RemoteBackend


class ClientBase:
    """What the sync and async clients share: backend selection and usage counting (the logic is in :mod:`call`)."""

    def __init__(
        self,
        model: str | None = None,
        *,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
        http_retries: int | None = None,
        http_backoff: float | None = None,
        engine: Any = None,
        tool_format: str | None = None,
        hooks: Hooks | None = None,
        **engine_config: Any,
    ) -> None:
        self._hooks = check_hooks(hooks) or NO_HOOKS
        self._backend: Backend | None = None
        self._backend_lock = threading.Lock()
        self._model = model
        self._tool_format = tool_format
        self._usage = Usage()
        self._usage_lock = threading.Lock()
        if base_url is not None:
            if engine is not None or engine_config or tool_format is not None:
                raise ConfigError(
                    "engine, engine options and tool_format apply to local models, not base_url"
                )
            retry = RetryPolicy(
                2 if http_retries is None else http_retries, 0.5 if http_backoff is None else http_backoff
            )
            self._backend = RemoteBackend(
                base_url, model or "default", api_key=api_key, timeout=timeout, retry=retry
            )
        elif http_retries is not None or http_backoff is not None:
            raise ConfigError("http_retries and http_backoff apply to remote servers (base_url)")
        elif engine is not None:
            if model is not None or engine_config:
                raise ConfigError("give either engine= or model=/engine options, not both")
            self._backend = LocalBackend(engine, self._format())
        elif api_key is not None:
            raise ConfigError("api_key needs base_url (a local model takes no key)")
        else:
            from agent_infer.engine.config import EngineConfig

            # Checked now so a misspelt option fails here, not at the first call.
            self._config = EngineConfig.from_kwargs(**engine_config)

    @classmethod
    def from_llm(cls: type[T], llm: Any, *, tool_format: str | None = None) -> T:
        """A client on an existing :class:`~agent_infer.LLM` (shares its engine and loaded weights).

        The client steps that engine from its own thread: do not call ``llm.generate`` at the same
        time, or each would consume the other's outputs. For both at once, build a second engine on
        the same weights (``LLMEngine(loaded=llm.engine.loaded)``).
        """
        return cls(engine=llm.engine, tool_format=tool_format)  # type: ignore[call-arg]

    def _format(self) -> Any:
        if self._tool_format is None:
            return None
        from agent_infer.tool_formats import get_format

        return get_format(self._tool_format)

    @property
    def backend(self) -> Backend:
        """The local or remote backend (a local model is loaded here, on first use)."""
        with self._backend_lock:
            if self._backend is None:
                from agent_infer.engine.llm_engine import LLMEngine

                engine = LLMEngine(self._model, self._config)
                self._backend = LocalBackend(engine, self._format())
            return self._backend

    @property
    def is_remote(self) -> bool:
        """True when calls go to a server."""
        return isinstance(self._backend, RemoteBackend)

    @property
    def usage(self) -> Usage:
        """Tokens used by every call of this client so far."""
        return self._usage

    def _count(self, usage: Usage | None) -> None:
        if usage is not None:
            with self._usage_lock:
                self._usage = self._usage + usage

    def _counted(self, response: ModelResponse) -> ModelResponse:
        self._count(response.usage)
        return response

    def _hooks_for(self, hooks: Hooks | None) -> Hooks:
        """The client's hooks, then the call's."""
        return self._hooks.then(check_hooks(hooks))


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
                prompt_or_messages, schema, regex, grammar, choice, system, decoding, validation_context
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
        )
        return self._drive(flow, self._hooks_for(hooks))

    @staticmethod
    def _run_tools(batch: ToolBatch) -> list[Outcome]:
        if not batch.parallel or len(batch.calls) < 2:
            return [execute(call) for call in batch.calls]
        with ThreadPoolExecutor(max_workers=len(batch.calls)) as pool:
            return list(pool.map(execute, batch.calls))

    def close(self) -> None:
        """Abort open local requests / close the HTTP connections."""
        if self._backend is not None:
            self._backend.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
