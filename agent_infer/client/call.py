"""What each client method asks for, without I/O: the sans-IO core both ``Client`` and ``AsyncClient`` drive.

A method's arguments are checked and turned into a *flow*: a generator that yields a
:class:`ModelRequest` (sent back the :class:`ModelResponse`) or a :class:`ToolBatch` (sent back one
outcome per call) and returns the method's result. Streaming methods become a :class:`StreamCall`
(the request, and how chunks turn into the items the caller sees). The two clients differ only in
how they perform those steps: blocking calls and threads, or ``await`` and ``asyncio.gather``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from agent_infer.client.agent import (
    RunResult,
    ToolBatch,
    check_complete_calls,
    check_tools,
    run_flow,
    validate_run_options,
)
from agent_infer.client.generation import PartialStream, generate_flow
from agent_infer.client.hooks import HookEvent, Hooks, ParseErrorEvent
from agent_infer.client.loop_control import LoopControlOption, check_loop_control
from agent_infer.client.request import (
    Completion,
    Constraint,
    Message,
    ModelRequest,
    ModelResponse,
    StreamChunk,
    ToolChoice,
    UsageLimits,
    as_messages,
)
from agent_infer.errors import InvalidRequestError, ValidationRetryError
from agent_infer.grammar.ir import Grammar
from agent_infer.structured import REQUEST_NUMBERS
from agent_infer.tools import Tool, as_tools

T = TypeVar("T")
ToolLike = Tool | Callable[..., Any] | Mapping[str, Any]
Prompt = str | Sequence[Mapping[str, Any]]
#: A method's logic: yields model requests, tool batches and hook events, returns the method's result.
Flow = Generator[ModelRequest | ToolBatch | HookEvent, Any, T]
#: JSON Schema front-end options of a call, as sorted (name, value) pairs (see schema_options).
SchemaOptions = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Decoding:
    """The decoding settings every client method takes (in its signature's order)."""

    temperature: float = 0.0
    max_tokens: int = 512
    seed: int | None = None
    top_p: float = 1.0
    stop: str | Sequence[str] | None = None
    close_on_length: bool = False
    loop_control: LoopControlOption = None


def check_retries(max_retries: int) -> None:
    """``max_retries`` must be a non-negative integer."""
    if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
        raise InvalidRequestError(
            f"max_retries must be a non-negative integer, got {max_retries!r}", field="max_retries"
        )


def build_request(
    prompt_or_messages: Prompt,
    decoding: Decoding,
    *,
    constraint: Constraint | None = None,
    tools: Sequence[Tool] = (),
    tool_choice: ToolChoice = "auto",
    parallel_tool_calls: bool = True,
    system: str | None = None,
) -> ModelRequest:
    """One model call from a method's arguments; bad input raises :class:`InvalidRequestError`."""
    if not isinstance(parallel_tool_calls, bool):
        raise InvalidRequestError("parallel_tool_calls must be a bool", field="parallel_tool_calls")
    if not isinstance(decoding.close_on_length, bool):
        raise InvalidRequestError("close_on_length must be a bool", field="close_on_length")
    check_loop_control(decoding.loop_control)
    stop = decoding.stop
    stops = (stop,) if isinstance(stop, str) else tuple(stop) if stop else None
    return ModelRequest(
        as_messages(prompt_or_messages, system),
        constraint,
        tuple(tools),
        tool_choice,
        parallel_tool_calls,
        decoding.temperature,
        decoding.max_tokens,
        decoding.seed,
        decoding.top_p,
        stops,
        decoding.close_on_length,
        decoding.loop_control,
    )


def generate_call(
    prompt_or_messages: Prompt,
    schema: Any,
    regex: str | None,
    grammar: Any,
    choice: Sequence[str] | None,
    max_retries: int,
    system: str | None,
    decoding: Decoding,
    with_completion: bool = False,
    validation_context: Any = None,
    schema_options: SchemaOptions = (),
) -> Flow[Any]:
    """``generate``: one constrained call, validated and re-asked at most ``max_retries`` times.

    ``with_completion``: the flow returns ``(value, Completion)`` instead of the value.
    """
    check_retries(max_retries)
    constraint = Constraint.from_keywords(schema=schema, regex=regex, grammar=grammar, choice=choice)
    check_validation_context(constraint, validation_context)
    constraint = with_schema_options(constraint, schema_options)
    request = build_request(prompt_or_messages, decoding, constraint=constraint, system=system)
    flow = generate_flow(request, max_retries, validation_context)
    return flow if with_completion else _value_only(flow)


def schema_options(unknown_formats: Any, unknown_keywords: Any, numbers: Any = "float64") -> SchemaOptions:
    """The JSON Schema front-end options a call sets that differ from the SDK's defaults, checked:
    ``unknown_formats`` / ``unknown_keywords`` ``"ignore"`` or ``"error"``, ``numbers``
    ``"float64"`` or ``"exact"`` (InvalidRequestError naming the argument)."""
    if unknown_formats == "ignore" and unknown_keywords == "ignore" and numbers == REQUEST_NUMBERS:
        return ()
    # The front end's allowed values, imported only when a call sets an option.
    from agent_infer.grammar.frontends.json_schema.entry import (
        NUMBER_POLICIES,
        UNKNOWN_FORMATS,
        UNKNOWN_KEYWORDS,
    )

    out: list[tuple[str, str]] = []
    for name, value, allowed, default in (
        ("unknown_formats", unknown_formats, UNKNOWN_FORMATS, "ignore"),
        ("unknown_keywords", unknown_keywords, UNKNOWN_KEYWORDS, "ignore"),
        ("numbers", numbers, NUMBER_POLICIES, REQUEST_NUMBERS),
    ):
        if type(value) is not str or value not in allowed:
            raise InvalidRequestError(
                f"{name} must be {' or '.join(map(repr, allowed))}, got {value!r}", field=name
            )
        if value != default:
            out.append((name, value))
    return tuple(out)


def with_schema_options(constraint: Constraint | None, options: SchemaOptions) -> Constraint | None:
    """``constraint`` carrying the schema options; options without ``schema=`` are an error (nothing
    would read them)."""
    if not options:
        return constraint
    if constraint is None or constraint.kind != "json_schema":
        raise InvalidRequestError(
            f"{options[0][0]} applies to schema= only (a JSON Schema or a Pydantic model or type)",
            field=options[0][0],
        )
    return dataclasses.replace(constraint, options=options)


def check_schema_options(constraint: Constraint) -> None:
    """Lower the constraint's schema with its options, raising what the front end refuses."""
    opts = dict(constraint.options)
    if "unknown_formats" in opts or "unknown_keywords" in opts:
        Grammar.from_json_schema(
            constraint.value,
            strict=False,
            unknown_formats=opts.get("unknown_formats", "ignore"),
            unknown_keywords=opts.get("unknown_keywords", "ignore"),
        )


def check_validation_context(constraint: Constraint | None, validation_context: Any) -> None:
    """A validation context needs Pydantic validators to reach: a schema given as a type or model.

    With a dict schema, regex, grammar, choice or free text nothing would ever read it, and a
    context the caller counts on must not be dropped without a word.
    """
    if validation_context is not None and (constraint is None or constraint.model is None):
        raise InvalidRequestError(
            "validation_context needs schema= as a Pydantic model or a type: only Pydantic "
            "validators read it",
            field="validation_context",
        )


def _value_only(flow: Generator[Any, Any, tuple[Any, Any]]) -> Flow[Any]:
    value, _ = yield from flow
    return value


def chat_request(
    messages: Prompt,
    tools: Iterable[ToolLike] | None,
    tool_choice: ToolChoice,
    parallel_tool_calls: bool,
    decoding: Decoding,
) -> ModelRequest:
    """The one model call of ``chat`` / ``chat_stream``."""
    return build_request(
        messages,
        decoding,
        tools=as_tools(tools),
        tool_choice=tool_choice,
        parallel_tool_calls=parallel_tool_calls,
    )


def chat_call(
    messages: Prompt,
    tools: Iterable[ToolLike] | None,
    tool_choice: ToolChoice,
    parallel_tool_calls: bool,
    decoding: Decoding,
    with_completion: bool = False,
) -> Flow[Any]:
    """``chat``: one call; the result is its assistant message (and its :class:`Completion`)."""
    flow = _message_of(chat_request(messages, tools, tool_choice, parallel_tool_calls, decoding))
    return flow if with_completion else _value_only(flow)


def chat_stream_call(
    messages: Prompt,
    tools: Iterable[ToolLike] | None,
    tool_choice: ToolChoice,
    parallel_tool_calls: bool,
    decoding: Decoding,
) -> StreamCall:
    """``chat_stream``: one streamed call whose chunks go to the caller as they are."""
    return StreamCall(chat_request(messages, tools, tool_choice, parallel_tool_calls, decoding))


def _message_of(request: ModelRequest) -> Flow[tuple[Message, Completion]]:
    response: ModelResponse = yield request
    check_complete_calls(request, response)
    raw = response.raw_text if response.raw_text is not None else response.content
    return response.message, Completion(raw, response.message, response.finish_reason, response.usage)


def run_call(
    messages: Prompt,
    tools: Iterable[ToolLike],
    schema: Any,
    max_turns: int,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool,
    max_tool_retries: int,
    decoding: Decoding,
    usage_limits: UsageLimits | None = None,
    deps: Any = None,
    validation_context: Any = None,
    schema_options: SchemaOptions = (),
) -> Flow[RunResult]:
    """``run``: the agent loop (``tool_choice`` defaults to "required" with a schema, else "auto")."""
    validate_run_options(max_turns, max_tool_retries)
    constraint = Constraint.from_keywords(schema=schema)
    check_validation_context(constraint, validation_context)
    constraint = with_schema_options(constraint, schema_options)
    if constraint is not None and constraint.options:
        # The answer is a tool call, whose schema is compiled with the tool grammar's own
        # options: what these options refuse is refused here, before any request, local or remote.
        check_schema_options(constraint)
    tool_objs = as_tools(tools)
    check_tools(tool_objs, constraint, deps)
    request = build_request(
        messages,
        decoding,
        tool_choice=tool_choice or ("required" if constraint is not None else "auto"),
        parallel_tool_calls=parallel_tool_calls,
    )
    if usage_limits is not None and not isinstance(usage_limits, UsageLimits):
        raise InvalidRequestError(
            f"usage_limits must be a UsageLimits, got {type(usage_limits).__name__}", field="usage_limits"
        )
    return run_flow(
        request,
        tool_objs,
        constraint,
        max_turns=max_turns,
        max_tool_retries=max_tool_retries,
        limits=usage_limits,
        deps=deps,
        validation_context=validation_context,
    )


class FlowStep(Generic[T]):
    """Where a flow stands: the pending ``op`` to perform, or ``done`` with its :meth:`result`."""

    def __init__(self, flow: Flow[T]) -> None:
        self._flow = flow
        self.done = False
        self._value: Any = None
        self.op: ModelRequest | ToolBatch | HookEvent
        self._advance(lambda: next(flow))

    def send(self, result: Any) -> None:
        """Hand the result of ``op`` to the flow and move to its next step."""
        self._advance(lambda: self._flow.send(result))

    def _advance(self, step: Callable[[], ModelRequest | ToolBatch | HookEvent]) -> None:
        try:
            self.op = step()
        except StopIteration as stop:
            self.done, self._value = True, stop.value

    def result(self) -> T:
        """The flow's return value (once ``done``)."""
        assert self.done
        return self._value


class StreamCall:
    """A streaming method: its ``request``, and the items each chunk (and the end) gives the caller.

    Plain (``chat_stream``): every chunk as it is. With ``partials`` (``generate_stream``): the
    partial values the text reveals, then the validated final value.
    """

    def __init__(self, request: ModelRequest, partials: PartialStream | None = None) -> None:
        self.request = request
        self._partials = partials
        self._reason = "stop"

    def feed(self, chunk: StreamChunk, hooks: Hooks | None = None) -> list[Any]:
        """The items this chunk makes visible (an invalid streamed item goes to ``hooks`` first)."""
        if self._partials is None:
            return [chunk]
        self._reason = chunk.finish_reason or self._reason
        try:
            return self._partials.feed(chunk.content)
        except ValidationRetryError as exc:
            _report(hooks, exc)
            raise

    def finish(self, hooks: Hooks | None = None) -> list[Any]:
        """The items after the last chunk (the final value when streaming partials); an invalid
        final value goes to ``hooks``' ``on_parse_error`` before its error is raised."""
        if self._partials is None:
            return []
        try:
            return self._partials.finish_items(self._reason)
        except ValidationRetryError as exc:
            _report(hooks, exc)
            raise


def _report(hooks: Hooks | None, exc: ValidationRetryError) -> None:
    if hooks is not None:
        hooks.parse_error(ParseErrorEvent(exc.raw_outputs[-1], exc.errors[-1], 1))


def generate_stream_call(
    prompt_or_messages: Prompt,
    schema: Any,
    regex: str | None,
    grammar: Any,
    choice: Sequence[str] | None,
    system: str | None,
    decoding: Decoding,
    validation_context: Any = None,
    schema_options: SchemaOptions = (),
) -> StreamCall:
    """``generate_stream``: one constrained streamed call read as partial values."""
    constraint = Constraint.from_keywords(schema=schema, regex=regex, grammar=grammar, choice=choice)
    check_validation_context(constraint, validation_context)
    constraint = with_schema_options(constraint, schema_options)
    request = build_request(prompt_or_messages, decoding, constraint=constraint, system=system)
    return StreamCall(request, PartialStream(constraint, validation_context))
