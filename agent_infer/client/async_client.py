"""``AsyncClient``: the :class:`~agent_infer.client.client.Client` API as coroutines.

Locally the engine is stepped by the backend's own thread and results arrive through an
``asyncio.Queue``, so ``asyncio.gather`` over many calls batches them in the engine. Remotely it
uses ``httpx.AsyncClient``. Async tools are awaited; sync tools run in worker threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from agent_infer.client import call
from agent_infer.client.agent import Outcome, RunResult, ToolBatch, aexecute
from agent_infer.client.base import ClientBase
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
from agent_infer.client.remote import RemoteBackend
from agent_infer.client.request import (
    Completion,
    Message,
    ModelRequest,
    StreamChunk,
    ToolChoice,
    UsageLimits,
)

T = TypeVar("T")


class AsyncClient(ClientBase):
    """The asynchronous client: ``await client.generate(...)``, ``async for p in client.generate_stream(...)``.

    A local model is loaded on first use, in a worker thread so the event loop keeps running.
    """

    async def _abackend(self) -> Any:
        if self._backend is None:
            return await asyncio.to_thread(lambda: self.backend)
        return self._backend

    async def _drive(self, flow: Flow[T], hooks: Hooks) -> T:
        """Perform a flow's steps: model requests awaited on the backend, tool batches concurrently,
        hook events."""
        backend = await self._abackend()
        step = FlowStep(flow)
        while not step.done:
            op = step.op
            if isinstance(op, ToolBatch):
                step.send(await self._run_tools(op))
            elif isinstance(op, ModelRequest):
                hooks.request(RequestEvent(op))
                with request_span(op, False) as span:
                    response = self._counted(await backend.acomplete(op))
                    record_response(span, response.finish_reason, response.usage)
                hooks.response(response_event(op, response))
                step.send(response)
            else:
                hooks.notify(op)
                step.send(None)
        return step.result()

    async def _stream(self, stream_call: StreamCall, hooks: Hooks) -> AsyncIterator[Any]:
        backend = await self._abackend()
        request = stream_call.request
        hooks.request(RequestEvent(request, stream=True))
        seen = StreamSeen()
        with request_span(request, True) as span:
            async for chunk in backend.astream(request):
                self._count(chunk.usage)
                seen.add(chunk)
                for item in stream_call.feed(chunk, hooks):
                    yield item
            record_response(span, seen.finish_reason, seen.usage)
        hooks.response(seen.event(request))
        for item in stream_call.finish(hooks):
            yield item

    async def generate(
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
        """See :meth:`Client.generate`."""
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
        return await self._drive(flow, self._hooks_for(hooks))

    async def generate_stream(
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
    ) -> AsyncIterator[Any]:
        """See :meth:`Client.generate_stream`."""
        decoding = Decoding(temperature, max_tokens, seed, top_p, stop, close_on_length, loop_control)
        partials = call.generate_stream_call(
            prompt_or_messages,
            schema,
            regex,
            grammar,
            choice,
            system,
            decoding,
            validation_context,
            schema_options=call.schema_options(unknown_formats, unknown_keywords, numbers),
        )
        async for item in self._stream(partials, self._hooks_for(hooks)):
            yield item

    async def chat(
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
        """See :meth:`Client.chat`."""
        decoding = Decoding(temperature, max_tokens, seed, top_p, stop, close_on_length, loop_control)
        return await self._drive(
            call.chat_call(messages, tools, tool_choice, parallel_tool_calls, decoding),
            self._hooks_for(hooks),
        )

    async def generate_with_completion(
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
        result: tuple[Any, Completion] = await self._drive(flow, self._hooks_for(hooks))
        return result

    async def chat_with_completion(
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
        result: tuple[Message, Completion] = await self._drive(flow, self._hooks_for(hooks))
        return result

    async def chat_stream(
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
    ) -> AsyncIterator[StreamChunk]:
        """See :meth:`Client.chat_stream`."""
        decoding = Decoding(temperature, max_tokens, seed, loop_control=loop_control)
        chunks = call.chat_stream_call(messages, tools, tool_choice, parallel_tool_calls, decoding)
        async for chunk in self._stream(chunks, self._hooks_for(hooks)):
            yield chunk

    async def run(
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
        """See :meth:`Client.run`; parallel tool calls run concurrently with ``asyncio.gather``."""
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
        return await self._drive(flow, self._hooks_for(hooks))

    @staticmethod
    async def _run_tools(batch: ToolBatch) -> list[Outcome]:
        if not batch.parallel or len(batch.calls) < 2:
            return [await aexecute(call) for call in batch.calls]
        return list(await asyncio.gather(*(aexecute(call) for call in batch.calls)))

    async def aclose(self) -> None:
        """Abort open local requests / close the HTTP connections."""
        if isinstance(self._backend, RemoteBackend):
            await self._backend.aclose()
        elif self._backend is not None:
            self._backend.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
