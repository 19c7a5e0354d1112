"""``POST /v1/chat/completions``: transcript and tools -> prompt and constraint -> message or SSE chunks."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agent_infer.engine.output import RequestOutput
from agent_infer.errors import AgentInferError, GrammarError, InvalidRequestError
from agent_infer.grammar.ir import Grammar
from agent_infer.server.async_engine import RequestStream
from agent_infer.server.errors import ApiError, constraint_error
from agent_infer.server.params import (
    build_constraint,
    build_sampling,
    chat_logprobs,
    resolve_max_tokens,
    warning_headers,
)
from agent_infer.server.protocol import ChatCompletionRequest, ChatMessage
from agent_infer.server.state import ServerState
from agent_infer.server.streaming import DONE, EngineStreamingResponse, IncrementalText, error_event, sse
from agent_infer.structured import StructuredOutput
from agent_infer.tool_formats import ContentDelta, ToolCallFormat
from agent_infer.tools import Tool


@dataclass(frozen=True)
class ChatPlan:
    """One chat request, translated: engine prompt and constraint, and how to read the output."""

    messages: list[dict[str, Any]]
    structured: StructuredOutput | None
    constraint_field: str | None
    warnings: tuple[str, ...]
    tool_format: ToolCallFormat | None  # set when the output may contain tool calls
    top_logprobs: int | None


def _message(index: int, msg: ChatMessage) -> dict[str, Any]:
    content = msg.content
    if isinstance(content, list):
        content = "".join(part.text or "" for part in content)
    # The template concatenates contents as strings; developer is OpenAI's newer name for system.
    out: dict[str, Any] = {
        "role": "system" if msg.role == "developer" else msg.role,
        "content": content or "",
    }
    if msg.name is not None:
        out["name"] = msg.name
    if msg.tool_call_id is not None:
        out["tool_call_id"] = msg.tool_call_id
    if msg.tool_calls:
        for j, call in enumerate(msg.tool_calls):
            try:
                json.loads(call.function.arguments)
            except ValueError as exc:
                raise ApiError(
                    400,
                    f"arguments are not JSON: {exc}",
                    param=f"messages.{index}.tool_calls.{j}.function.arguments",
                ) from None
        out["tool_calls"] = [c.model_dump(exclude_none=True) for c in msg.tool_calls]
    return out


def _tools(req: ChatCompletionRequest) -> list[Tool]:
    tools = []
    for i, spec in enumerate(req.tools or []):
        try:
            tools.append(Tool.from_openai(spec.model_dump(exclude_none=True)))
        except InvalidRequestError as exc:
            raise ApiError(400, f"tools.{i}: {exc}", param=f"tools.{i}.function") from exc
    return tools


def _tool_grammar(fmt: ToolCallFormat, tools: list[Tool], req: ChatCompletionRequest) -> Grammar:
    choice: Any = req.tool_choice or "auto"
    if not isinstance(choice, str):
        choice = {"name": choice.function.name}
    try:
        return fmt.grammar(
            tools, tool_choice=choice, parallel_tool_calls=req.parallel_tool_calls is not False
        )
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param=exc.field or "tool_choice") from exc
    except GrammarError as exc:
        # Name the tool whose parameters failed: re-lower each alone (only on this error path).
        for i, tool in enumerate(tools):
            try:
                Grammar.from_json_schema(tool.parameters, strict=tool.strict)
            except GrammarError as inner:
                raise constraint_error(inner, f"tools.{i}.function.parameters") from exc
        raise constraint_error(exc, "tools") from exc


def plan_chat(state: ServerState, req: ChatCompletionRequest) -> ChatPlan:
    """Build the engine prompt and constraint; bad input raises a 400 naming the field."""
    messages = [_message(i, m) for i, m in enumerate(req.messages)]
    tools = _tools(req)
    fmt = state.tool_format
    if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        try:
            rendered = fmt.render_tools(messages, tools)
        except (KeyError, ValueError) as exc:
            raise ApiError(400, f"cannot render the tool transcript: {exc}", param="messages") from exc
        messages = rendered if isinstance(rendered, list) else messages
    constraint = build_constraint(req)
    structured, where = constraint.structured, constraint.field
    calls_possible = bool(tools) and req.tool_choice != "none"
    if calls_possible and structured is not None:
        raise ApiError(
            400, f"{where} cannot be combined with tools unless tool_choice is 'none'", param=where
        )
    out_format: ToolCallFormat | None = None
    if tools and structured is None:
        structured = StructuredOutput.grammar(_tool_grammar(fmt, tools, req))
        where = "tools"
        out_format = fmt if calls_possible else None
    return ChatPlan(
        messages=messages,
        structured=structured,
        constraint_field=where,
        warnings=constraint.warnings,
        tool_format=out_format,
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
    )


async def create_chat_completion(
    state: ServerState, req: ChatCompletionRequest, request: Request
) -> Response:
    """Answer one chat completion request (JSON or SSE)."""
    req.check_supported()
    state.check_model(req.model)
    plan = plan_chat(state, req)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = resolve_max_tokens(
        req.max_completion_tokens or req.max_tokens, field, state.config.max_tokens_limit
    )
    params = build_sampling(
        req, max_tokens=max_tokens, structured=plan.structured, logprobs=plan.top_logprobs
    )
    request_id = state.new_id("chatcmpl")
    stream = await state.submit(request_id, plan.messages, params, plan.constraint_field)
    if req.stream:
        first = await state.first_output(stream, request)
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        body = _chunks(state, plan, request_id, first, stream, params.stop_strings, include_usage)
        return EngineStreamingResponse(
            body, lambda: state.release(request_id, False), warning_headers(plan.warnings)
        )
    output = await state.final_output(stream, request)
    return JSONResponse(_response(state, plan, request_id, output), headers=warning_headers(plan.warnings))


def _response(state: ServerState, plan: ChatPlan, request_id: str, output: RequestOutput) -> dict[str, Any]:
    completion = output.outputs[0]
    message: dict[str, Any] = {"role": "assistant", "content": completion.text, "refusal": None}
    finish = completion.finish_reason
    if plan.tool_format is not None:
        parsed = plan.tool_format.parse(completion.text)
        if parsed.tool_calls:
            message["content"] = parsed.content or None
            message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
            if finish == "stop":
                finish = "tool_calls"
    logprobs = None
    if plan.top_logprobs is not None and completion.logprobs is not None:
        logprobs = {
            "content": chat_logprobs(
                state.tokenizer, completion.token_ids, completion.logprobs, plan.top_logprobs
            )
        }
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": state.model_name,
        "system_fingerprint": None,
        "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
        "usage": _usage(output),
    }


def _usage(output: RequestOutput) -> dict[str, int]:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _chunks(
    state: ServerState,
    plan: ChatPlan,
    request_id: str,
    first: RequestOutput,
    stream: RequestStream,
    stop: tuple[str, ...],
    include_usage: bool,
) -> AsyncIterator[bytes]:
    created = int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> bytes:
        payload: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": state.model_name,
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }
        if include_usage:
            payload["usage"] = None
        return sse(payload)

    finished = False
    try:
        yield chunk({"role": "assistant", "content": ""})
        text = IncrementalText(stop)
        parser = plan.tool_format.stream_parser() if plan.tool_format is not None else None
        saw_calls = False
        output = first
        while True:
            step = text.advance(output)
            deltas: list[dict[str, Any]] = []
            if parser is not None:
                events = parser.feed(step.text) if step.text else []
                if output.finished:
                    events += parser.finish()
                for event in events:
                    if isinstance(event, ContentDelta):
                        deltas.append({"content": event.text})
                    else:
                        saw_calls = True
                        deltas.append({"tool_calls": [event.to_openai()]})
            elif step.text:
                deltas.append({"content": step.text})
            logprobs = None
            if plan.top_logprobs is not None and step.token_ids:
                entries = chat_logprobs(state.tokenizer, step.token_ids, step.logprobs, plan.top_logprobs)
                logprobs = {"content": entries}
                if not deltas:
                    deltas.append({"content": ""})
            for i, delta in enumerate(deltas):
                yield chunk(delta, logprobs=logprobs if i == 0 else None)
            if output.finished:
                finished = True
                reason = output.finish_reason
                if reason in ("error", "abort"):
                    yield error_event(
                        output.outputs[0].error or f"request ended: {reason}", reason or "error"
                    )
                    yield DONE
                    return
                yield chunk({}, finish="tool_calls" if saw_calls and reason == "stop" else reason)
                if include_usage:
                    yield sse(
                        {
                            "id": request_id,
                            "object": "chat.completion.chunk",
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
