"""``POST /v1/responses`` (OpenAI's Responses API) on top of the chat pipeline.

A request is translated into a chat completion request (``input`` items and ``instructions`` into
messages, ``text.format`` into ``response_format``, flat function tools into chat tools), planned
and sampled exactly like one, and its message turned into output items: an ``output_text``
message and ``function_call`` items. Streams send the Responses event sequence. Responses are kept
in server memory (``response_store.MAX_STORED`` of them, least recent out) so that ``previous_response_id``
continues a conversation and ``GET /v1/responses/{id}`` returns one.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import Field, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agent_infer.engine.output import RequestOutput
from agent_infer.server.chat import _ChatResponder, plan_chat
from agent_infer.server.errors import ApiError, validation_error
from agent_infer.server.params import build_sampling, resolve_max_tokens, warning_headers
from agent_infer.server.protocol import ChatCompletionRequest, Count, _Strict
from agent_infer.server.responses_stream import call_item, message_item, reasoning_item, response_events
from agent_infer.server.state import ServerState
from agent_infer.server.streaming import EngineStreamingResponse


class TextFormat(_Strict):
    """``text.format``: plain text, any JSON object, or a JSON Schema (named, strict by default)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None
    unknown_formats: Literal["ignore", "error"] | None = None
    unknown_keywords: Literal["ignore", "error"] | None = None
    numbers: Literal["float64", "exact"] | None = None


class TextOptions(_Strict):
    """``text``: the output format (``verbosity`` is accepted and ignored, as on chat)."""

    format: TextFormat | None = None
    verbosity: str | None = None


class FunctionTool(_Strict):
    """A Responses function tool (flat: no ``function`` wrapper)."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedTool(_Strict):
    """``tool_choice: {"type": "function", "name": ...}``."""

    type: Literal["function"]
    name: str


class ContentItem(_Strict):
    """A text content part of an input message (``reasoning_text``: of an echoed reasoning item)."""

    type: Literal["input_text", "output_text", "reasoning_text"]
    text: str
    annotations: list[Any] | None = None


class InputItem(_Strict):
    """An input item: a message (``type`` may be left out), a function call, a call's output, or a
    reasoning item echoed back from an earlier response."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] | None = None
    id: str | None = None
    status: str | None = None
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[ContentItem] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None
    summary: list[Any] | None = None
    encrypted_content: str | None = None


class ResponsesRequest(_Strict):
    """``POST /v1/responses``."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    previous_response_id: str | None = None
    text: TextOptions | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled"] | None = None


def _text_of(content: str | list[ContentItem] | None) -> str:
    if isinstance(content, list):
        return "".join(part.text for part in content)
    return content or ""


def _messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages; consecutive function calls become one assistant turn."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.type or "message"
        if kind == "reasoning":
            continue  # earlier turns' thinking stays out of the prompt, as in chat's reasoning_content
        if kind == "message":
            if item.role is None:
                raise ApiError(400, "a message item needs a role", param=f"input.{i}.role")
            out.append({"role": item.role, "content": _text_of(item.content)})
        elif kind == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise ApiError(400, "a function_call needs call_id, name and arguments", param=f"input.{i}")
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            if item.call_id is None or item.output is None:
                raise ApiError(400, "a function_call_output needs call_id and output", param=f"input.{i}")
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
    return out


# Chat field -> Responses field, for errors the chat pipeline names.
_PARAMS = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
)


def _renamed(exc: ApiError) -> ApiError:
    param = exc.param or ""
    for chat, ours in _PARAMS:
        if param.startswith(chat):
            exc.param = ours + param[len(chat) :]
            break
    if param.startswith("tools.") and ".function." in param:
        exc.param = param.replace(".function.", ".", 1)
    return exc


def _chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    for name in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.tools:
        body["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
            for t in req.tools
        ]
    if req.tool_choice is not None:
        choice = req.tool_choice
        body["tool_choice"] = (
            choice if isinstance(choice, str) else {"type": "function", "function": {"name": choice.name}}
        )
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        spec: dict[str, Any] = {"type": fmt.type}
        if fmt.type == "json_schema":
            if fmt.schema_ is None:
                raise ApiError(
                    400, "text.format.schema is required for json_schema", param="text.format.schema"
                )
            spec["json_schema"] = {"name": fmt.name or "response", "schema": fmt.schema_}
            for name in ("strict", "unknown_formats", "unknown_keywords", "numbers"):
                if getattr(fmt, name) is not None:
                    spec["json_schema"][name] = getattr(fmt, name)
        body["response_format"] = spec
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise _renamed(validation_error(exc)) from None


def _usage(output: RequestOutput) -> dict[str, Any]:
    prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


class _Run:
    """One Responses request: the translated chat plan, and building the response object."""

    def __init__(self, state: ServerState, req: ResponsesRequest) -> None:
        self.state, self.req = state, req
        self.id = "resp_" + uuid.uuid4().hex
        self.created = int(time.time())
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            history = list(state.responses.get(req.previous_response_id, "previous_response_id")[1])
        self.transcript = history + _messages(req.input)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        try:
            self.chat = _chat_request(req, system + self.transcript)
            self.chat.check_supported()
            state.check_model(req.model)
            self.plan = plan_chat(state, self.chat)
            max_tokens = resolve_max_tokens(
                req.max_output_tokens, "max_output_tokens", state.config.max_tokens_limit
            )
            self.params = build_sampling(
                self.chat,
                max_tokens=max_tokens,
                structured=self.plan.structured,
                logprobs=None,
                vocab_size=state.engine.engine.vocab_size,
            )
        except ApiError as exc:
            raise _renamed(exc) from None
        self.responder = _ChatResponder(state, self.id, self.plan)

    def body(self, items: list[dict[str, Any]], output: RequestOutput | None, status: str) -> dict[str, Any]:
        """The response object with ``items`` as its output."""
        req = self.req
        tool_choice: Any = req.tool_choice or "auto"
        if not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump()
        fmt = (
            req.text.format.model_dump(by_alias=True, exclude_none=True)
            if req.text and req.text.format
            else {"type": "text"}
        )
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.state.model_name,
            "output": items,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "store": req.store is not False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": {"format": fmt},
            "tool_choice": tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "truncation": "disabled",
            "metadata": req.metadata or {},
            "usage": _usage(output) if output is not None else None,
        }

    def finish(self, items: list[dict[str, Any]], output: RequestOutput) -> dict[str, Any]:
        """The final body; stored (with its transcript) unless ``store`` is false."""
        status = "incomplete" if output.finish_reason == "length" else "completed"
        body = self.body(items, output, status)
        if self.req.store is not False:
            reply: list[dict[str, Any]] = []
            text = "".join(c["text"] for i in items if i["type"] == "message" for c in i["content"])
            calls = [
                {
                    "id": i["call_id"],
                    "type": "function",
                    "function": {"name": i["name"], "arguments": i["arguments"]},
                }
                for i in items
                if i["type"] == "function_call"
            ]
            message: dict[str, Any] = {"role": "assistant", "content": text or None}
            if calls:
                message["tool_calls"] = calls
            reply.append(message)
            self.state.responses.put(body, self.transcript + reply)
        return body


def _items_of(message: dict[str, Any]) -> list[dict[str, Any]]:
    items = [reasoning_item(message["reasoning_content"])] if message.get("reasoning_content") else []
    if message.get("content"):
        items.append(message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        items.append(call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


async def create_response(state: ServerState, req: ResponsesRequest, request: Request) -> Response:
    """Answer one Responses request (JSON, or the Responses SSE event sequence)."""
    run = _Run(state, req)
    try:
        stream = await state.submit(run.id, run.plan.messages, run.params, run.plan.constraint_field)
    except ApiError as exc:
        raise _renamed(exc) from None
    headers = warning_headers(run.plan.warnings, [stream])
    if not req.stream:
        output = await state.final_output(stream, request)
        message = run.responder.choice(output)["message"]
        return JSONResponse(run.finish(_items_of(message), output), headers=headers)
    first = await state.first_output(stream, request)
    return EngineStreamingResponse(
        response_events(run, first, stream), lambda: state.release(run.id, False), headers
    )
