"""Server-sent events: encoding, and turning cumulative engine snapshots into safe text increments."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from agent_infer.engine.output import RequestOutput

DONE = b"data: [DONE]\n\n"

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event carrying ``payload`` as compact JSON."""
    return (
        b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"
    )


@dataclass(frozen=True)
class Increment:
    """What a snapshot adds: new text, the new tokens and their logprobs entries."""

    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]]


class IncrementalText:
    """Turns cumulative outputs into increments that never need to be taken back.

    The engine cuts a stop string from the text only once all of it has been generated, so while a
    request runs the last ``len(longest stop) - 1`` characters are held back: they may be the start
    of a stop string that will disappear.
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self._sent_text = 0
        self._sent_tokens = 0

    def advance(self, output: RequestOutput) -> Increment:
        """The part of ``output`` not yet sent."""
        text = output.text
        end = len(text) if output.finished else max(self._sent_text, len(text) - self._holdback)
        new_text = text[self._sent_text : end]
        self._sent_text = end
        completion = output.outputs[0]
        new_tokens = completion.token_ids[self._sent_tokens :]
        entries = (completion.logprobs or [])[self._sent_tokens :]
        self._sent_tokens = len(completion.token_ids)
        return Increment(new_text, new_tokens, entries)


def error_event(message: str, code: str) -> bytes:
    """The event that ends a stream which failed after its 200 status was sent."""
    return sse({"error": {"message": message, "type": "server_error", "param": None, "code": code}})


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that runs ``on_close`` however it ends.

    If the client goes away before the body generator is first entered, the generator's own
    ``finally`` never runs; this hook still releases (aborts) the engine request then.
    """

    def __init__(
        self, body: AsyncIterator[bytes], on_close: Callable[[], None], headers: dict[str, str]
    ) -> None:
        super().__init__(body, media_type="text/event-stream", headers={**SSE_HEADERS, **headers})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
