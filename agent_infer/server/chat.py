"""``POST /v1/chat/completions``: transcript and tools -> prompt and constraint -> message or SSE chunks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from agent_infer.engine.output import RequestOutput
from agent_infer.errors import GrammarError, InvalidRequestError
from agent_infer.grammar.ir import Grammar
from agent_infer.server.body import parse_json
from agent_infer.server.errors import ApiError, constraint_error
from agent_infer.server.params import (
    build_constraint,
    build_sampling,
    chat_logprobs,
    resolve_max_tokens,
)
from agent_infer.server.protocol import ChatCompletionRequest, ChatMessage, ToolSpec
from agent_infer.server.reasoning import ReasoningStream, split_reasoning, think_then
from agent_infer.server.responder import Responder
from agent_infer.server.router_fields import bootstrap_of
from agent_infer.server.state import ServerState
from agent_infer.server.streaming import Increment
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
    reasoning: bool = False  # split ``<think>...</think>`` into ``reasoning_content``


def _cut_in_call(fmt: ToolCallFormat, text: str) -> tuple[str, list[dict[str, Any]]] | None:
    """Content and calls of an output cut by ``max_tokens`` inside a call; None if it was not.

    The stream parser's view of an unfinished output holds back what may still become a call; the
    whole-text parse reads a half call as text. They agree (up to trailing whitespace) exactly when
    no call was cut, and otherwise the held-back view is the answer: the calls as far as they got,
    and no fragment of a call delimiter in the content, as a stream would have sent them.
    """
    content = ""
    calls: list[dict[str, Any]] = []
    for event in fmt.stream_parser().feed(text):
        if isinstance(event, ContentDelta):
            content += event.text
        elif event.id is not None:
            calls.append(
                {"id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}}
            )
        else:
            calls[event.index]["function"]["arguments"] += event.arguments
    whole = fmt.parse(text)
    same_calls = len(whole.tool_calls) == len(calls) and all(
        c.name == d["function"]["name"] and _json_or_none(d["function"]["arguments"]) == c.arguments
        for c, d in zip(whole.tool_calls, calls, strict=False)
    )
    if same_calls and whole.content.rstrip() == content.rstrip():
        return None
    return content, calls


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


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
            where = f"messages.{index}.tool_calls.{j}.function.arguments"
            parse_json(call.function.arguments, where, where)
        out["tool_calls"] = [c.model_dump(exclude_none=True) for c in msg.tool_calls]
    return out


def _tools(specs: list[ToolSpec]) -> list[Tool]:
    tools = []
    for i, spec in enumerate(specs):
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


def render_messages(
    state: ServerState, msgs: list[ChatMessage], specs: list[ToolSpec]
) -> list[dict[str, Any]]:
    """The transcript as chat-template messages: tools and tool calls written in the model's format."""
    messages = [_message(i, m) for i, m in enumerate(msgs)]
    tools = _tools(specs)
    if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        try:
            rendered = state.tool_format.render_tools(messages, tools)
        except (KeyError, ValueError) as exc:
            raise ApiError(400, f"cannot render the tool transcript: {exc}", param="messages") from exc
        messages = rendered if isinstance(rendered, list) else messages
    return messages


def plan_chat(state: ServerState, req: ChatCompletionRequest) -> ChatPlan:
    """Build the engine prompt and constraint; bad input raises a 400 naming the field."""
    messages = render_messages(state, req.messages, req.tools or [])
    tools = _tools(req.tools or [])
    fmt = state.tool_format
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
    reasoning = state.config.reasoning_parser is not None
    if reasoning and req.stream and req.stream_reasoning is False:
        raise ApiError(
            400,
            "stream_reasoning=false is unsupported: the thinking is streamed as reasoning_content deltas",
            param="stream_reasoning",
        )
    if reasoning and structured is not None:
        # The constraint is on the answer: the thinking before it stays free.
        try:
            structured = StructuredOutput.grammar(think_then(structured.to_grammar()))
        except GrammarError as exc:
            raise constraint_error(exc, where or "response_format") from exc
    return ChatPlan(
        messages=messages,
        structured=structured,
        constraint_field=where,
        warnings=constraint.warnings,
        tool_format=out_format,
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        # separate_reasoning=false (SGLang's): the thinking stays in the content.
        reasoning=reasoning and req.separate_reasoning is not False,
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
        req,
        max_tokens=max_tokens,
        structured=plan.structured,
        logprobs=plan.top_logprobs,
        vocab_size=state.engine.engine.vocab_size,
    )
    responder = _ChatResponder(state, state.new_id("chatcmpl"), plan)
    responder.bootstrap = bootstrap_of(req)
    return await responder.respond(req, request, plan.messages, params, plan.constraint_field, plan.warnings)


class _ChatResponder(Responder):
    """Chat choices: an assistant ``message`` (tool calls parsed in the model's format) or streamed deltas."""

    body_object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    chunk_fingerprint = True

    def __init__(self, state: ServerState, request_id: str, plan: ChatPlan) -> None:
        super().__init__(state, request_id)
        self._plan = plan
        self._parser = plan.tool_format.stream_parser() if plan.tool_format is not None else None
        self._reasoning = ReasoningStream() if plan.reasoning else None
        self._saw_calls = False

    def fork(self) -> _ChatResponder:
        """Another choice's responder: same plan, its own tool-call stream parser."""
        return _ChatResponder(self.state, self.request_id, self._plan)

    def _logprobs(self, token_ids: list[int], entries: list[dict[int, float]]) -> dict[str, Any]:
        assert self._plan.top_logprobs is not None
        return {"content": chat_logprobs(self.state.tokenizer, token_ids, entries, self._plan.top_logprobs)}

    def choice(self, output: RequestOutput) -> dict[str, Any]:
        """The assistant message; "tool_calls" as the finish reason when it called tools."""
        completion = output.outputs[0]
        text: str | None = completion.text
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if self._plan.reasoning:
            split = split_reasoning(completion.text)
            text = message["content"] = split.content
            message["reasoning_content"] = split.reasoning
        text = text or ""
        finish = completion.finish_reason
        fmt = self._plan.tool_format
        cut = _cut_in_call(fmt, text) if fmt is not None and finish == "length" else None
        if cut is not None:
            message["content"] = cut[0] or None
            if cut[1]:
                message["tool_calls"] = cut[1]
        elif fmt is not None:
            parsed = fmt.parse(text)
            if parsed.tool_calls:
                message["content"] = parsed.content or None
                message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
                if finish == "stop":
                    finish = "tool_calls"
        logprobs = None
        if self._plan.top_logprobs is not None and completion.logprobs is not None:
            logprobs = self._logprobs(completion.token_ids, completion.logprobs)
        return {"message": message, "logprobs": logprobs, "finish_reason": finish}

    def opening(self) -> list[dict[str, Any]]:
        """The role comes first, with empty content."""
        return [{"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]

    def increment(self, step: Increment, output: RequestOutput) -> list[dict[str, Any]]:
        """Reasoning, text and tool-call deltas; the step's logprobs ride on the first."""
        deltas: list[dict[str, Any]] = []
        text = step.text
        if self._reasoning is not None:
            thinking, text = self._reasoning.feed(step.text)
            if output.finished:
                more_thinking, more_text = self._reasoning.finish()
                thinking, text = thinking + more_thinking, text + more_text
            if thinking:
                deltas.append({"reasoning_content": thinking})
        if self._parser is not None:
            events = self._parser.feed(text) if text else []
            # A call cut by max_tokens stays as far as it was streamed: the final flush would
            # re-read the half call as text and send it again as content.
            fmt = self._plan.tool_format
            if output.finished and not (
                output.finish_reason == "length"
                and fmt is not None
                and _cut_in_call(fmt, self._answer(output.text)) is not None
            ):
                events += self._parser.finish()
            for event in events:
                if isinstance(event, ContentDelta):
                    deltas.append({"content": event.text})
                else:
                    self._saw_calls = True
                    deltas.append({"tool_calls": [event.to_openai()]})
        elif text:
            deltas.append({"content": text})
        logprobs = None
        if self._plan.top_logprobs is not None and step.token_ids:
            logprobs = self._logprobs(step.token_ids, step.logprobs)
            if not deltas:
                deltas.append({"content": ""})
        return [
            {"delta": delta, "logprobs": logprobs if i == 0 else None, "finish_reason": None}
            for i, delta in enumerate(deltas)
        ]

    def _answer(self, text: str) -> str:
        """The part of the output tool calls are read from: after the thinking, when it is split off."""
        return (split_reasoning(text).content or "") if self._plan.reasoning else text

    def finish(self, reason: str | None) -> dict[str, Any]:
        """An empty delta; "tool_calls" when the model called tools and stopped."""
        finish = "tool_calls" if self._saw_calls and reason == "stop" else reason
        return {"delta": {}, "logprobs": None, "finish_reason": finish}
