"""``POST /v1/completions``: one text (or token-id) prompt -> text, as JSON or SSE chunks."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agent_infer.engine.output import RequestOutput
from agent_infer.errors import AgentInferError
from agent_infer.server.async_engine import RequestStream
from agent_infer.server.params import (
    build_constraint,
    build_sampling,
    completion_logprobs,
    resolve_max_tokens,
    warning_headers,
)
from agent_infer.server.protocol import CompletionRequest
from agent_infer.server.state import ServerState
from agent_infer.server.streaming import DONE, EngineStreamingResponse, IncrementalText, error_event, sse

# OpenAI's default for /v1/completions when max_tokens is not given.
_DEFAULT_MAX_TOKENS = 16


async def create_completion(state: ServerState, req: CompletionRequest, request: Request) -> Response:
    """Answer one text completion request (JSON or SSE)."""
    req.check_supported()
    state.check_model(req.model)
    prompt = _prompt(req.prompt)
    constraint = build_constraint(req)
    limit = state.config.max_tokens_limit
    max_tokens = resolve_max_tokens(req.max_tokens or min(_DEFAULT_MAX_TOKENS, limit), "max_tokens", limit)
    params = build_sampling(
        req, max_tokens=max_tokens, structured=constraint.structured, logprobs=req.logprobs
    )
    request_id = state.new_id("cmpl")
    stream = await state.submit(request_id, prompt, params, constraint.field)
    headers = warning_headers(constraint.warnings)
    if req.stream:
        first = await state.first_output(stream, request)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        body = _chunks(state, req.logprobs, request_id, first, stream, params.stop_strings, include_usage)
        return EngineStreamingResponse(body, lambda: state.release(request_id, False), headers)
    output = await state.final_output(stream, request)
    completion = output.outputs[0]
    logprobs = None
    if req.logprobs is not None and completion.logprobs is not None:
        logprobs = completion_logprobs(
            state.tokenizer, completion.token_ids, completion.logprobs, req.logprobs, 0
        )
    return JSONResponse(
        {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": state.model_name,
            "system_fingerprint": None,
            "choices": [
                {
                    "index": 0,
                    "text": completion.text,
                    "logprobs": logprobs,
                    "finish_reason": completion.finish_reason,
                }
            ],
            "usage": _usage(output),
        },
        headers=headers,
    )


def _prompt(prompt: str | list[str] | list[int]) -> str | list[int]:
    """The one prompt: text, a one-element list of text, or token ids."""
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], str):
        return str(prompt[0])
    return [int(t) for t in prompt]


def _usage(output: RequestOutput) -> dict[str, int]:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _chunks(
    state: ServerState,
    top_logprobs: int | None,
    request_id: str,
    first: RequestOutput,
    stream: RequestStream,
    stop: tuple[str, ...],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(text: str, finish: str | None = None, logprobs: Any = None) -> bytes:
        payload: dict[str, Any] = {
            "id": request_id,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        }
        if include_usage:
            payload["usage"] = None
        return sse(payload)

    finished = False
    offset = 0
    try:
        text = IncrementalText(stop)
        output = first
        while True:
            step = text.advance(output)
            logprobs = None
            if top_logprobs is not None and step.token_ids:
                logprobs = completion_logprobs(
                    state.tokenizer, step.token_ids, step.logprobs, top_logprobs, offset
                )
            offset += len(step.text)
            if step.text or logprobs is not None:
                yield chunk(step.text, logprobs=logprobs)
            if output.finished:
                finished = True
                reason = output.finish_reason
                if reason in ("error", "abort"):
                    yield error_event(
                        output.outputs[0].error or f"request ended: {reason}", reason or "error"
                    )
                    yield DONE
                    return
                yield chunk("", finish=reason)
                if include_usage:
                    yield sse(
                        {
                            "id": request_id,
                            "object": "text_completion",
                            "created": created,
                            "model": state.model_name,
                            "choices": [],
                            "usage": _usage(output),
                        }
                    )
                yield DONE
                return
            output = await stream.next()
    except AgentInferError as exc:
        yield error_event(str(exc), type(exc).__name__)
        yield DONE
    finally:
        state.release(request_id, finished)
