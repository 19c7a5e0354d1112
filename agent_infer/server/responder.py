"""Engine outputs -> OpenAI response objects: what chat and text completions share.

A :class:`Responder` subclass says what one endpoint's choice looks like (for the whole output,
for a streamed increment, and for the finish); this base submits the request and writes the JSON
body or the SSE stream around those choices: ids, framing, usage, the error event that ends a
failed stream, and the release of the engine request however the stream ends.
"""

from __future__ import annotations

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
from agent_infer.server.protocol import ChatCompletionRequest, CompletionRequest
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


def usage(output: RequestOutput) -> dict[str, Any]:
    """The ``usage`` object of a finished request; ``cached_tokens``: prompt tokens the prefix cache served."""
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": output.num_cached_tokens},
    }


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

    async def respond(
        self,
        req: ChatCompletionRequest | CompletionRequest,
        request: Request,
        prompt: Any,
        params: SamplingParams,
        constraint_field: str | None,
        headers: dict[str, str],
    ) -> Response:
        """Submit the request and answer with the JSON body, or with SSE chunks when ``req.stream``."""
        state, request_id = self.state, self.request_id
        stream = await state.submit(request_id, prompt, params, constraint_field)
        if req.stream:
            first = await state.first_output(stream, request)
            include_usage = req.stream_options is not None and req.stream_options.include_usage
            body = self._events(first, stream, params.stop_strings, include_usage)
            return EngineStreamingResponse(body, lambda: state.release(request_id, False), headers)
        output = await state.final_output(stream, request)
        return JSONResponse(
            {
                "id": request_id,
                "object": self.body_object,
                "created": int(time.time()),
                "model": state.model_name,
                "system_fingerprint": None,
                "choices": [{"index": 0, **self.choice(output)}],
                "usage": usage(output),
            },
            headers=headers,
        )

    async def _events(
        self, first: RequestOutput, stream: RequestStream, stop: tuple[str, ...], include_usage: bool
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        head = {
            "id": self.request_id,
            "object": self.chunk_object,
            "created": created,
            "model": self.state.model_name,
        }

        def chunk(choice: Choice) -> bytes:
            payload: dict[str, Any] = dict(head)
            if self.chunk_fingerprint:
                payload["system_fingerprint"] = None
            payload["choices"] = [{"index": 0, **choice}]
            if include_usage:
                payload["usage"] = None
            return sse(payload)

        finished = False
        try:
            for choice in self.opening():
                yield chunk(choice)
            text = IncrementalText(stop)
            output = first
            while True:
                for choice in self.increment(text.advance(output), output):
                    yield chunk(choice)
                if output.finished:
                    finished = True
                    reason = output.finish_reason
                    if reason in ("error", "abort"):
                        yield error_event(
                            output.outputs[0].error or f"request ended: {reason}", reason or "error"
                        )
                    else:
                        yield chunk(self.finish(reason))
                        if include_usage:
                            yield sse({**head, "choices": [], "usage": usage(output)})
                    yield DONE
                    return
                output = await stream.next()
        except AgentInferError as exc:
            yield error_event(str(exc), type(exc).__name__)
            yield DONE
        except Exception as exc:
            # The 200 is sent: the failure can only be reported in the stream, which still ends
            # properly, so the client's keep-alive connection stays usable.
            logger.exception("unhandled error in stream %s", self.request_id, exc_info=exc)
            yield error_event(f"internal error: {type(exc).__name__}: {exc}", "internal_error")
            yield DONE
        finally:
            self.state.release(self.request_id, finished)
