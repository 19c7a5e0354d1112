"""``AsyncClient``: the :class:`~agent_infer.client.client.Client` API as coroutines.

Locally the engine is stepped by the backend's own thread and results arrive through an
``asyncio.Queue``, so ``asyncio.gather`` over many calls batches them in the engine. Remotely it
uses ``httpx.AsyncClient``. Async tools are awaited; sync tools run in worker threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Generator, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from agent_infer.client.agent import (
    Outcome,
    RunResult,
    ToolBatch,
    aexecute,
    check_tools,
    run_flow,
    validate_run_options,
)
from agent_infer.client.client import ClientBase, ToolLike, check_retries, tool_list
from agent_infer.client.generation import PartialStream, generate_flow
from agent_infer.client.remote import RemoteBackend
from agent_infer.client.request import Constraint, Message, ModelResponse, StreamChunk, ToolChoice

T = TypeVar("T")


class AsyncClient(ClientBase):
    """The asynchronous client: ``await client.generate(...)``, ``async for p in client.generate_stream(...)``.

    A local model is loaded on first use, in a worker thread so the event loop keeps running.
    """

    async def _abackend(self) -> Any:
        if self._backend is None:
            return await asyncio.to_thread(lambda: self.backend)
        return self._backend

    async def _drive(self, flow: Generator[Any, Any, T]) -> T:
        backend = await self._abackend()
        try:
            op = next(flow)
            while True:
                if isinstance(op, ToolBatch):
                    result: Any = await self._run_tools(op)
                else:
                    result = await backend.acomplete(op)
                    self._count(result.usage)
                op = flow.send(result)
        except StopIteration as stop:
            return stop.value

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
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
    ) -> Any:
        """See :meth:`Client.generate`."""
        check_retries(max_retries)
        constraint = Constraint.from_keywords(schema=schema, regex=regex, grammar=grammar, choice=choice)
        request = self._request(
            prompt_or_messages,
            constraint=constraint,
            system=system,
            temperature=temperature,
            max_tokens=max_tokens,
            seed=seed,
            top_p=top_p,
            stop=stop,
        )
        value, _ = await self._drive(generate_flow(request, max_retries))
        return value

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
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
    ) -> AsyncIterator[Any]:
        """See :meth:`Client.generate_stream`."""
        constraint = Constraint.from_keywords(schema=schema, regex=regex, grammar=grammar, choice=choice)
        request = self._request(
            prompt_or_messages,
            constraint=constraint,
            system=system,
            temperature=temperature,
            max_tokens=max_tokens,
            seed=seed,
            top_p=top_p,
            stop=stop,
        )
        backend = await self._abackend()
        partials = PartialStream(constraint)
        reason = "stop"
        async for chunk in backend.astream(request):
            for partial in partials.feed(chunk.content):
                yield partial
            reason = chunk.finish_reason or reason
            self._count(chunk.usage)
        yield partials.finish(reason)

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
        top_p: float = 1.0,
        stop: str | Sequence[str] | None = None,
    ) -> Message:
        """See :meth:`Client.chat`."""
        request = self._request(
            messages,
            tools=tool_list(tools),
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            temperature=temperature,
            max_tokens=max_tokens,
            seed=seed,
            top_p=top_p,
            stop=stop,
        )
        backend = await self._abackend()
        response: ModelResponse = await backend.acomplete(request)
        self._count(response.usage)
        return response.message

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
    ) -> AsyncIterator[StreamChunk]:
        """See :meth:`Client.chat_stream`."""
        request = self._request(
            messages,
            tools=tool_list(tools),
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            temperature=temperature,
            max_tokens=max_tokens,
            seed=seed,
        )
        backend = await self._abackend()
        async for chunk in backend.astream(request):
            self._count(chunk.usage)
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
    ) -> RunResult:
        """See :meth:`Client.run`; parallel tool calls run concurrently with ``asyncio.gather``."""
        validate_run_options(max_turns, max_tool_retries)
        constraint = Constraint.from_keywords(schema=schema)
        tool_objs = tool_list(tools)
        check_tools(tool_objs, constraint)
        request = self._request(
            messages,
            tool_choice=tool_choice or ("required" if constraint is not None else "auto"),
            parallel_tool_calls=parallel_tool_calls,
            temperature=temperature,
            max_tokens=max_tokens,
            seed=seed,
        )
        return await self._drive(
            run_flow(request, tool_objs, constraint, max_turns=max_turns, max_tool_retries=max_tool_retries)
        )

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
