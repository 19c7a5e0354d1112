"""The agent loop behind ``client.run``: call the model, execute its tool calls, repeat until an answer.

Like :mod:`generation`, the loop is a generator (``run_flow``) yielding either a
:class:`ModelRequest` (sent back a :class:`ModelResponse`) or a :class:`ToolBatch` (sent back one
:data:`Outcome` per call), so the sync and async clients share it and differ only in how they call
the model and run tools (threads vs. ``asyncio.gather``).

With a ``schema`` the final answer is a call of an extra tool, ``final_result``, whose parameters
are the schema (the pydantic-ai approach): under ``tool_choice="required"`` every turn is a real
tool call or the answer, and the answer's arguments are validated like ``generate(schema=...)``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic

from agent_infer.client.generation import OutputInvalid, decode
from agent_infer.client.hooks import HookEvent, ParseErrorEvent, ToolCallEvent
from agent_infer.client.request import Constraint, Message, ModelRequest, ModelResponse, Usage, UsageLimits
from agent_infer.errors import (
    IncompleteToolCallError,
    InvalidRequestError,
    MaxTurnsExceeded,
    ToolCallError,
    UsageLimitExceeded,
)
from agent_infer.tools import (
    RunContext,
    Tool,
    ToolArgumentsError,
    ToolDefinitionError,
    ToolRetry,
)
from agent_infer.tools.context import context_deps_type

__all__ = [
    "FINAL_TOOL",
    "Outcome",
    "PendingCall",
    "RunResult",
    "ToolBatch",
    "aexecute",
    "execute",
    "run_flow",
]

FINAL_TOOL = "final_result"
_WRAP_KEY = "result"

#: How one tool call went: ("ok" | "retry" | "error", the text shown to the model).
Outcome = tuple[str, str]


@dataclass(frozen=True)
class RunResult:
    """What ``client.run`` returns: the final ``output``, every message, and the summed token usage."""

    output: Any
    transcript: list[Message]
    usage: Usage
    turns: int


@dataclass(frozen=True)
class PendingCall:
    """One tool call the model made (``tool`` is None when it named no known tool).

    ``context`` is what the tool receives when its first parameter is a ``RunContext``.
    """

    id: str
    name: str
    arguments: str
    tool: Tool | None
    context: RunContext[Any] | None = None


@dataclass(frozen=True)
class ToolBatch:
    """The calls of one assistant turn, to run concurrently when ``parallel``."""

    calls: list[PendingCall]
    parallel: bool


def _render_result(result: Any) -> str:
    if isinstance(result, str):
        return result
    if isinstance(result, pydantic.BaseModel):
        return result.model_dump_json()
    try:
        return json.dumps(result, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(result)


def _classify(exc: BaseException) -> Outcome:
    if isinstance(exc, ToolRetry):
        return "retry", str(exc)
    if isinstance(exc, ToolArgumentsError):
        return "error", f"Error: {exc}"
    return "error", f"Error: {type(exc).__name__}: {exc}"


def execute(call: PendingCall) -> Outcome:
    """Run one call in this thread; exceptions become the text the model sees."""
    if call.tool is None:
        return "error", f"Error: there is no tool named {call.name!r}"
    try:
        return "ok", _render_result(call.tool.invoke(call.arguments, call.context))
    except Exception as exc:  # a failing tool is reported to the model, not raised
        return _classify(exc)


async def aexecute(call: PendingCall) -> Outcome:
    """Async :func:`execute` (sync tools run in a worker thread)."""
    if call.tool is None:
        return "error", f"Error: there is no tool named {call.name!r}"
    try:
        return "ok", _render_result(await call.tool.ainvoke(call.arguments, call.context))
    except Exception as exc:
        return _classify(exc)


def final_tool(constraint: Constraint) -> Tool:
    """The ``final_result`` tool whose arguments are the answer (non-object schemas are wrapped)."""
    schema = constraint.value
    if not (isinstance(schema, dict) and schema.get("type") == "object"):
        inner = dict(schema) if isinstance(schema, dict) else schema
        # "#/$defs/..." references are relative to the document root: the definitions move up with them.
        defs = {k: inner.pop(k) for k in ("$defs", "definitions") if isinstance(inner, dict) and k in inner}
        schema = {"type": "object", "properties": {_WRAP_KEY: inner}, "required": [_WRAP_KEY], **defs}
    return Tool(
        name=FINAL_TOOL,
        description="Give the final answer. Call this once you have everything you need.",
        parameters=schema,
    )


def check_tools(tools: Sequence[Tool], constraint: Constraint | None, deps: Any = None) -> None:
    """Tools for ``run`` must be callable, ``final_result`` is reserved when a schema is given, and
    ``deps`` must be an instance of the ``Deps`` class a tool's ``RunContext[Deps]`` names (checked
    before anything runs, so a wrong dependency fails here and not inside a tool mid-run)."""
    for t in tools:
        if t.function is None:
            raise ToolDefinitionError(
                f"tool {t.name!r} has no Python function; run() executes tools", field="tools"
            )
        wanted = context_deps_type(t.context_type)
        if wanted is not None and not isinstance(deps, wanted):
            raise InvalidRequestError(
                f"tool {t.name!r} takes RunContext[{wanted.__name__}] but deps= is {type(deps).__name__}",
                field="deps",
            )
        if constraint is not None and t.name == FINAL_TOOL:
            raise ToolDefinitionError(
                f"the tool name {FINAL_TOOL!r} is reserved for the final answer when schema= is given",
                field="tools",
            )


def check_complete_calls(request: ModelRequest, response: ModelResponse) -> None:
    """:class:`IncompleteToolCallError` when the output ran out of ``max_tokens`` inside a tool call.

    A cut-off call cannot be executed, and handing back the rest as if the turn were whole would
    drop the call silently; the remedies (a larger ``max_tokens``, bounded parameters,
    ``close_on_length=True``) are the caller's to choose.
    """
    if response.unfinished_call is None:
        return
    raise IncompleteToolCallError(
        f"the output ran out of max_tokens={request.max_tokens} inside a tool call; raise max_tokens, "
        "bound the tool's parameters (max_length, maximum) or pass close_on_length=True",
        tool=response.unfinished_call or None,
        raw_output=response.raw_text if response.raw_text is not None else response.content,
        tool_calls=response.tool_calls,
        max_tokens=request.max_tokens,
    )


def _final_value(constraint: Constraint, arguments: str, context: Any = None) -> Any:
    args = json.loads(arguments) if arguments.strip() else {}
    if not (isinstance(constraint.value, dict) and constraint.value.get("type") == "object"):
        args = args.get(_WRAP_KEY) if isinstance(args, dict) else args
    return decode(constraint, json.dumps(args, ensure_ascii=False), "stop", context)


def run_flow(
    request: ModelRequest,
    tools: Sequence[Tool],
    constraint: Constraint | None,
    *,
    max_turns: int,
    max_tool_retries: int,
    limits: UsageLimits | None = None,
    deps: Any = None,
    validation_context: Any = None,
) -> Generator[ModelRequest | ToolBatch | HookEvent, Any, RunResult]:
    """The agent loop; see the module docstring for the protocol. Tools taking a ``RunContext`` get
    ``deps``. Each executed call and each invalid answer is also yielded as a hook event."""
    limits = limits or UsageLimits()
    tool_calls_run = 0
    by_name = {t.name: t for t in tools}
    all_tools = (*tools, final_tool(constraint)) if constraint is not None else tuple(tools)
    transcript = list(request.messages)
    usage = Usage()
    retries: dict[str, int] = {}
    answered: dict[tuple[str, str], str] = {}
    choice = request.tool_choice
    invalid_answers = 0
    for turn in range(1, max_turns + 1):
        _check_limit("max_requests", limits.max_requests, usage.requests + 1, usage, transcript)
        response: ModelResponse = yield dataclasses.replace(
            request, messages=list(transcript), tools=all_tools, constraint=None, tool_choice=choice
        )
        usage = usage + response.usage
        check_complete_calls(request, response)
        transcript.append(response.message)
        _check_limit("max_total_tokens", limits.max_total_tokens, usage.total_tokens, usage, transcript)
        calls = response.tool_calls
        if not calls:
            if constraint is None:
                return RunResult(response.content, transcript, usage, turn)
            transcript.append({"role": "user", "content": f"Answer by calling {FINAL_TOOL}."})
            continue
        pending = [
            PendingCall(
                c.get("id") or f"call_{turn}_{i}",
                c["function"]["name"],
                c["function"].get("arguments") or "{}",
                by_name.get(c["function"]["name"]),
                RunContext(deps, c["function"]["name"], c.get("id") or f"call_{turn}_{i}", turn),
            )
            for i, c in enumerate(calls)
        ]
        final = next((p for p in pending if p.name == FINAL_TOOL), None)
        if final is not None and constraint is not None:
            try:
                return RunResult(
                    _final_value(constraint, final.arguments, validation_context), transcript, usage, turn
                )
            except (OutputInvalid, json.JSONDecodeError) as exc:
                invalid_answers += 1
                yield ParseErrorEvent(final.arguments, str(exc), invalid_answers)
                transcript.append(_tool_message(final, f"Error: the answer is not valid: {exc}"))
                continue
        # A call repeated with the same arguments, in an earlier turn or earlier in this one, is
        # answered from the first result instead of running again (tools may have side effects),
        # and the next turn must answer: a model that repeats itself has got all it will get from
        # the tools (small models loop otherwise).
        fresh = _first_of_each(pending, answered)
        tool_calls_run += len(fresh)
        _check_limit("max_tool_calls", limits.max_tool_calls, tool_calls_run, usage, transcript)
        outcomes: list[Outcome] = (yield ToolBatch(fresh, request.parallel_tool_calls)) if fresh else []
        results = dict(zip((_key(p) for p in fresh), outcomes))
        for call, (status, text) in zip(fresh, outcomes):
            yield ToolCallEvent(call.name, call.arguments, call.id, status, text, turn)
        shown: dict[tuple[str, str], str] = {}  # what each call of this turn got, for its copies
        for call in pending:
            key = _key(call)
            if any(call is f for f in fresh):
                status, text = results[key]
                if status == "ok":
                    answered[key] = text
                elif status == "retry":
                    retries[call.name] = retries.get(call.name, 0) + 1
                    if retries[call.name] > max_tool_retries:
                        raise ToolCallError(
                            f"the tool asked for a corrected call more than {max_tool_retries} time(s): {text}",
                            tool=call.name,
                            arguments=call.arguments,
                        )
                    text = f"Retry: {text}\nCall the tool again with corrected arguments."
                shown[key] = text
            else:
                # Only the first result: an instruction inside a tool result is text a small
                # model repeats as its answer. The next turn's tool_choice makes it answer.
                text = shown.get(key, answered.get(key, ""))
                if key in answered:
                    choice = {"name": FINAL_TOOL} if constraint is not None else "none"
            transcript.append(_tool_message(call, text))
    raise MaxTurnsExceeded(
        f"no final answer after {max_turns} model call(s)",
        transcript=transcript,
        max_turns=max_turns,
        usage=usage,
    )


def _check_limit(name: str, bound: int | None, reached: int, usage: Usage, transcript: list[Message]) -> None:
    """:class:`UsageLimitExceeded` when going on would spend ``reached`` of something bounded by ``bound``."""
    if bound is not None and reached > bound:
        raise UsageLimitExceeded(
            f"the run would exceed its usage limit ({name.removeprefix('max_').replace('_', ' ')}: {reached})",
            limit=name,
            value=bound,
            usage=usage,
            transcript=list(transcript),
        )


def _first_of_each(pending: Sequence[PendingCall], answered: dict[tuple[str, str], str]) -> list[PendingCall]:
    """The calls to run: the first of each (name, arguments) not answered in an earlier turn."""
    seen: set[tuple[str, str]] = set()
    out: list[PendingCall] = []
    for call in pending:
        key = _key(call)
        if key not in answered and key not in seen:
            seen.add(key)
            out.append(call)
    return out


def _key(call: PendingCall) -> tuple[str, str]:
    try:
        canonical = json.dumps(json.loads(call.arguments), sort_keys=True)
    except json.JSONDecodeError:
        canonical = call.arguments
    return call.name, canonical


def _tool_message(call: PendingCall, content: str) -> Message:
    return {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}


def validate_run_options(max_turns: int, max_tool_retries: int) -> None:
    """Typed errors for nonsense loop bounds."""
    if isinstance(max_turns, bool) or not isinstance(max_turns, int) or max_turns < 1:
        raise InvalidRequestError(
            f"max_turns must be a positive integer, got {max_turns!r}", field="max_turns"
        )
    if isinstance(max_tool_retries, bool) or not isinstance(max_tool_retries, int) or max_tool_retries < 0:
        raise InvalidRequestError(
            f"max_tool_retries must be a non-negative integer, got {max_tool_retries!r}",
            field="max_tool_retries",
        )
