"""Engine outputs -> OpenAI response objects: what chat and text completions share.

A :class:`Responder` subclass says what one endpoint's choice looks like (for the whole output,
for a streamed increment, and for the finish); this base submits the request and writes the JSON
body or the SSE stream around those choices: ids, framing, usage, the error event that ends a
failed stream, and the release of the engine request however the stream ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any, ClassVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agent_infer.engine.output import RequestOutput
from agent_infer.errors import AgentInferError
from agent_infer.sampling_params import SamplingParams
from agent_infer.server.async_engine import RequestStream
from agent_infer.server.errors import ApiError
from agent_infer.server.params import warning_headers
from agent_infer.server.protocol import ChatCompletionRequest, CompletionRequest
from agent_infer.server.router_fields import Bootstrap
from agent_infer.server.state import ServerState
from agent_infer.server.streaming import (
    DONE,
    EngineStreamingResponse,
    Increment,
    IncrementalText,
    error_event,
    sse,
)

Choice = dict[str, Any]

logger = logging.getLogger(__name__)


def usage(outputs: list[RequestOutput]) -> dict[str, Any]:
    """The ``usage`` object of finished choices (one prompt, all completions); ``cached_tokens``:
    prompt tokens the prefix cache served."""
    prompt = len(outputs[0].prompt_token_ids)
    completion = sum(len(o.token_ids) for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": outputs[0].num_cached_tokens},
    }


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of choice ``index`` of ``n``: a given seed advances per choice (so the choices
    differ but the whole answer stays reproducible), wrapping within 64 bits."""
    if index == 0 or params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + index + 2**63) % 2**64 - 2**63)


class _StreamEnded(Exception):
    """A choice's request ended with ``error`` or ``abort`` after the 200 was sent."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class Responder(ABC):
    """Answers one request of one endpoint; subclasses build the choices (without their ``index``)."""

    #: ``object`` of the JSON body and of each streamed chunk.
    body_object: ClassVar[str]
    chunk_object: ClassVar[str]
    #: Whether streamed chunks carry ``system_fingerprint`` (chat chunks do, text chunks do not).
    chunk_fingerprint: ClassVar[bool]

    def __init__(self, state: ServerState, request_id: str) -> None:
        self.state = state
        self.request_id = request_id
        #: sglang-router's PD fields, when this request is one half of a prefill/decode pair.
        self.bootstrap: Bootstrap | None = None

    @abstractmethod
    def choice(self, output: RequestOutput) -> Choice:
        """The choice of a non-streamed answer."""

    def opening(self) -> list[Choice]:
        """The choices streamed before any text."""
        return []

    @abstractmethod
    def increment(self, step: Increment, output: RequestOutput) -> list[Choice]:
        """The choices that stream what ``step`` adds (``output`` is the snapshot it came from)."""

    @abstractmethod
    def finish(self, reason: str | None) -> Choice:
        """The choice of the chunk that ends a stream which finished normally."""

    def fork(self) -> Responder:
        """A fresh responder for another choice of the same request (its own streaming state)."""
        raise NotImplementedError

    async def respond(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        request: Request,
        prompt: Any,
        params: SamplingParams,
        constraint_field: str | None,
        warnings: tuple[str, ...],
    ) -> Response:
        """Submit the request's ``n`` choices and answer with the JSON body, or SSE when ``req.stream``;
        ``warnings`` and the engine's for the constraint go in the warnings header."""
        state = self.state
        n = req.n or 1
        if self.bootstrap is not None and n > 1:
            raise ApiError(400, "n > 1 is not served across a prefill/decode pair", param="n")
        responders = [self] + [self.fork() for _ in range(n - 1)]
        ids = [self.request_id] if n == 1 else [f"{self.request_id}-{i}" for i in range(n)]
        streams: list[RequestStream] = []
        try:
            for i, request_id in enumerate(ids):
                streams.append(
                    await state.submit(
                        request_id, prompt, choice_params(params, i), constraint_field, self.bootstrap
                    )
                )
            if req.stream:
                firsts = [await state.first_output(stream, request) for stream in streams]
        except BaseException:
            for stream in streams:
                state.release(stream.request_id, False)
            raise
        headers = warning_headers(warnings, streams)
        if req.stream:
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            body = self._events(responders, firsts, streams, params.stop_strings, include_usage)

            def close() -> None:
                for stream in streams:
                    state.release(stream.request_id, False)

            return EngineStreamingResponse(body, close, headers)
        outputs = await state.final_outputs(streams, request)
        return JSONResponse(
            {
                "id": self.request_id,
                "object": self.body_object,
                "created": int(time.time()),
                "model": state.model_name,
                "system_fingerprint": None,
                "choices": [{"index": i, **r.choice(o)} for i, (r, o) in enumerate(zip(responders, outputs))],
                "usage": usage(outputs),
            },
            headers=headers,
        )

    async def _events(
        self,
        responders: list[Responder],
        firsts: list[RequestOutput],
        streams: list[RequestStream],
        stop: tuple[str, ...],
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        head = {
            "id": self.request_id,
            "object": self.chunk_object,
            "created": created,
            "model": self.state.model_name,
        }

        def chunk(index: int, choice: Choice) -> bytes:
            payload: dict[str, Any] = dict(head)
            if self.chunk_fingerprint:
                payload["system_fingerprint"] = None
            payload["choices"] = [{"index": index, **choice}]
            if include_usage:
                payload["usage"] = None
            return sse(payload)

        n = len(streams)
        finals: list[RequestOutput | None] = [None] * n
        # Each choice runs as its own task; their chunks interleave in one queue, in the order the
        # engine produced them. ("chunk", bytes) or ("end", exception or None) per choice.
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        async def run(index: int) -> None:
            responder, stream, output = responders[index], streams[index], firsts[index]
            try:
                for choice in responder.opening():
                    queue.put_nowait(("chunk", chunk(index, choice)))
                text = IncrementalText(stop)
                while True:
                    for choice in responder.increment(text.advance(output), output):
                        queue.put_nowait(("chunk", chunk(index, choice)))
                    if output.finished:
                        finals[index] = output
                        reason = output.finish_reason
                        if reason in ("error", "abort"):
                            raise _StreamEnded(
                                output.outputs[0].error or f"request ended: {reason}", reason or "error"
                            )
                        queue.put_nowait(("chunk", chunk(index, responder.finish(reason))))
                        break
                    output = await stream.next()
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                queue.put_nowait(("end", exc))
                return
            queue.put_nowait(("end", None))

        tasks = [asyncio.create_task(run(i)) for i in range(n)]
        try:
            ended = 0
            while ended < n:
                kind, item = await queue.get()
                if kind == "chunk":
                    yield item
                    continue
                ended += 1
                if item is None:
                    continue
                if isinstance(item, _StreamEnded):
                    yield error_event(str(item), item.code)
                elif isinstance(item, AgentInferError):
                    yield error_event(str(item), type(item).__name__)
                else:
                    # The 200 is sent: the failure can only be reported in the stream, which still
                    # ends properly, so the client's keep-alive connection stays usable.
                    logger.exception("unhandled error in stream %s", self.request_id, exc_info=item)
                    yield error_event(f"internal error: {type(item).__name__}: {item}", "internal_error")
                yield DONE
                return
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage([o for o in finals if o is not None])})
            yield DONE
        finally:
            for task in tasks:
                task.cancel()
            for stream, final in zip(streams, finals):
                self.state.release(stream.request_id, final is not None)
