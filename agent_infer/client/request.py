"""What a client asks a backend for and what comes back: one model call, local or remote.

The ``Client`` logic (validation retries, streaming partials, the agent loop) is written against
these types only, so the local engine and a remote OpenAI-compatible server are interchangeable.
"""

from __future__ import annotations

import collections.abc
import json
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pydantic

from agent_infer.client.loop_control import LoopControlOption
from agent_infer.errors import InvalidRequestError
from agent_infer.grammar.ir import Grammar
from agent_infer.tool_formats.base import ToolCallDelta
from agent_infer.tools import Tool
from agent_infer.tools.schema import no_json_form_path, warn_any_json

Message = dict[str, Any]
ToolChoice = str | Mapping[str, Any]


@dataclass(frozen=True)
class Constraint:
    """The output constraint of one call: ``kind`` is json_schema, regex, grammar or choice.

    ``value`` is the JSON Schema dict, the regex, the grammar (GBNF text or a :class:`Grammar`) or
    the tuple of choices; ``model`` the Pydantic class, or a ``TypeAdapter`` when the schema came
    from another type (``list[int]``, ``Literal``, an ``Enum``, a union of models).
    """

    kind: str
    value: Any
    model: Any = field(default=None, compare=False)
    #: The item type when the schema was ``Iterable[Item]`` (the value is then a list of items).
    item: Any = field(default=None, compare=False)
    #: JSON Schema front-end options (``unknown_formats``, ``unknown_keywords``, ``numbers``) that
    #: differ from the SDK's defaults, as (name, value) pairs.
    options: tuple[tuple[str, str], ...] = ()

    @property
    def is_model(self) -> bool:
        """True when the schema came from a Pydantic model class (partials are model instances)."""
        return isinstance(self.model, type) and issubclass(self.model, pydantic.BaseModel)

    def validate(self, value: Any, context: Any = None) -> Any:
        """``value`` (parsed JSON) as the schema's Python type, ``context`` passed to the validators
        (``info.context``); raises ``pydantic.ValidationError``."""
        if isinstance(self.model, pydantic.TypeAdapter):
            return self.model.validate_python(value, context=context)
        return self.model.model_validate(value, context=context)

    @classmethod
    def from_keywords(
        cls, *, schema: Any = None, regex: str | None = None, grammar: Any = None, choice: Any = None
    ) -> Constraint | None:
        """The one constraint among the keywords (None when none is given); two or more is an error."""
        given = {
            k: v
            for k, v in (("schema", schema), ("regex", regex), ("grammar", grammar), ("choice", choice))
            if v is not None
        }
        if len(given) > 1:
            raise InvalidRequestError(
                f"give at most one of schema=, regex=, grammar=, choice= (got {', '.join(given)})",
                field=next(iter(given)),
            )
        if schema is not None:
            if isinstance(schema, type) and issubclass(schema, pydantic.BaseModel):
                return cls("json_schema", close_objects(_model_schema(schema, schema.__name__)), schema)
            if isinstance(schema, dict | bool):
                return cls("json_schema", schema)
            if _ITERABLES.intersection((schema, typing.get_origin(schema))):
                return cls._iterable(schema)
            if _is_type(schema):
                adapter = pydantic.TypeAdapter(schema)
                return cls("json_schema", close_objects(_model_schema(adapter, _type_name(schema))), adapter)
            raise InvalidRequestError(
                "schema must be a Pydantic model, a type (list[int], Literal[...], an Enum, a union of "
                f"models) or a JSON Schema dict, got {type(schema).__name__}",
                field="schema",
            )
        if regex is not None:
            if not isinstance(regex, str) or not regex:
                raise InvalidRequestError("regex must be a non-empty string", field="regex")
            return cls("regex", regex)
        if grammar is not None:
            if not isinstance(grammar, str | Grammar):
                raise InvalidRequestError(
                    "grammar must be GBNF text or an agent_infer.grammar.Grammar", field="grammar"
                )
            return cls("grammar", grammar)
        if choice is not None:
            if (
                isinstance(choice, str)
                or not isinstance(choice, Sequence)
                or not choice
                or not all(isinstance(c, str) for c in choice)
            ):
                raise InvalidRequestError("choice must be a non-empty list of strings", field="choice")
            return cls("choice", tuple(choice))
        return None

    @classmethod
    def _iterable(cls, schema: Any) -> Constraint:
        """``Iterable[Item]`` (instructor's multi-object output): a JSON array of items, validated as
        ``list[Item]`` (a list, not pydantic's lazy iterator, so every item is checked before the
        value is returned); streams yield each item once its value closes."""
        args = typing.get_args(schema)
        if len(args) != 1:
            raise InvalidRequestError("schema=Iterable[...] needs one item type", field="schema")
        item = args[0]
        adapter = pydantic.TypeAdapter(list[item])  # type: ignore[valid-type]
        name = f"Iterable[{_type_name(item)}]"
        return cls("json_schema", close_objects(_model_schema(adapter, name)), adapter, item)

    @property
    def is_json(self) -> bool:
        """True when the output is a JSON document."""
        return self.kind == "json_schema"

    @property
    def grammar_text(self) -> str:
        """The grammar as GBNF text (what a remote server is sent)."""
        return str(self.value)  # a Grammar prints as GBNF


@dataclass(frozen=True)
class ModelRequest:
    """One model call: the conversation, an optional constraint or tools, and decoding settings."""

    messages: list[Message]
    constraint: Constraint | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    temperature: float = 0.0
    max_tokens: int = 512
    seed: int | None = None
    top_p: float = 1.0
    stop: tuple[str, ...] | None = None
    close_on_length: bool = False
    #: None (the SDK's default: on for constrained local calls), False (off) or a LoopControl.
    loop_control: LoopControlOption = None
    #: How many ``length`` failures this call follows: each one escalates the loop control.
    loop_escalation: int = 0
    #: The last attempt after a ``length`` failure: with loop control on, it closes at max_tokens.
    loop_last_attempt: bool = False
    #: A ``length`` failure of this call is retried (``generate``'s attempts before its last): the
    #: closing pressure near ``max_tokens`` stays off, since a fresh attempt beats a forced end.
    retried_on_length: bool = False

    @property
    def forces_calls(self) -> bool:
        """True when the output may only be tool calls (``tool_choice`` "required" or a named tool)."""
        return bool(self.tools) and (self.tool_choice == "required" or isinstance(self.tool_choice, Mapping))


@dataclass(frozen=True)
class Usage:
    """Token counts, summed over every model call of an operation."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    requests: int = 0

    @property
    def total_tokens(self) -> int:
        """Prompt plus completion tokens."""
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(
            self.prompt_tokens + other.prompt_tokens,
            self.completion_tokens + other.completion_tokens,
            self.requests + other.requests,
        )


@dataclass(frozen=True)
class UsageLimits:
    """Bounds on what one ``run`` may spend; None means no bound.

    ``max_requests``: model calls; ``max_total_tokens``: prompt plus completion tokens summed over
    the run (checked after each model call, so the call that crosses it is counted);
    ``max_tool_calls``: tool executions (checked before a turn's calls run, so none of an
    over-budget turn runs).
    """

    max_requests: int | None = None
    max_total_tokens: int | None = None
    max_tool_calls: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_total_tokens", "max_tool_calls"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InvalidRequestError(
                    f"{name} must be a positive integer or None, got {value!r}", field=f"usage_limits.{name}"
                )


@dataclass(frozen=True)
class ModelResponse:
    """One model call's answer: the assistant message (OpenAI shape), its finish reason and usage.

    ``unfinished_call`` is set when the output ran out of ``max_tokens`` inside a tool call: the
    tool's name, or "" when it is not known. ``raw_text`` is the model's text before parsing.
    """

    message: Message
    finish_reason: str
    usage: Usage
    unfinished_call: str | None = None
    raw_text: str | None = None

    @property
    def content(self) -> str:
        """The assistant's text ('' when it only called tools)."""
        return self.message.get("content") or ""

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        """The OpenAI-shaped tool calls (``arguments`` as JSON text)."""
        return list(self.message.get("tool_calls") or [])


@dataclass(frozen=True)
class Completion:
    """The model output behind a returned value: what instructor calls the raw completion.

    ``text`` is the model's raw text, ``message`` the OpenAI-shaped assistant message,
    ``finish_reason`` how the output ended ("stop", "length", "tool_calls"), ``usage`` the tokens of
    every attempt and ``attempts`` how many model calls it took (validation retries included).
    """

    text: str
    message: Message
    finish_reason: str
    usage: Usage
    attempts: int = 1


@dataclass(frozen=True)
class StreamChunk:
    """A piece of a streamed answer: new text and/or tool-call deltas; the last has ``finish_reason``."""

    content: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    finish_reason: str | None = None
    usage: Usage | None = None


def _model_schema(model: Any, name: str) -> dict[str, Any]:
    """The JSON Schema of a Pydantic model or ``TypeAdapter``; a field without a JSON form is an
    error naming its path, and spots that accept any JSON value are warned about
    (:class:`~agent_infer.tools.AnyJSONWarning`)."""
    try:
        schema: dict[str, Any] = (
            model.json_schema() if isinstance(model, pydantic.TypeAdapter) else model.model_json_schema()
        )
    except pydantic.errors.PydanticUserError as exc:
        path = no_json_form_path(model._type if isinstance(model, pydantic.TypeAdapter) else model)
        where = f"field {path!r} of {name}" if path else name
        raise InvalidRequestError(
            f"schema: {where} has no JSON Schema form: {exc.message}",
            field=f"schema.{path}" if path else "schema",
        ) from None
    warn_any_json(schema, f"schema {name}")
    return schema


_ITERABLES = {collections.abc.Iterable, collections.abc.Iterator}


def _is_type(schema: Any) -> bool:
    """A Python type or type expression (``int``, ``list[int]``, ``Literal["a"]``, ``A | B``)."""
    return isinstance(schema, type | types.UnionType) or typing.get_origin(schema) is not None


def _type_name(schema: Any) -> str:
    return schema.__name__ if isinstance(schema, type) else repr(schema).replace("typing.", "")


def close_objects(schema: Any) -> Any:
    """``additionalProperties: false`` on every object schema with declared properties (OpenAI's strict
    rule): Pydantic drops unknown keys anyway, and an open object lets a model add keys forever."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {
        k: (
            {name: close_objects(sub) for name, sub in v.items()}
            if k in ("properties", "$defs", "definitions") and isinstance(v, dict)
            else v
            if k in ("enum", "const", "default", "examples")
            else close_objects(v)
        )
        for k, v in schema.items()
    }
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def assistant_message(content: str | None, tool_calls: Sequence[Mapping[str, Any]]) -> Message:
    """An OpenAI assistant message (``tool_calls`` only when there are some)."""
    message: Message = {"role": "assistant", "content": content if content else None}
    if tool_calls:
        message["tool_calls"] = [dict(c) for c in tool_calls]
    elif message["content"] is None:
        message["content"] = ""
    return message


def as_messages(
    prompt_or_messages: str | Sequence[Mapping[str, Any]], system: str | None = None
) -> list[Message]:
    """A plain prompt becomes one user message; a message list is checked and copied."""
    if isinstance(prompt_or_messages, str):
        if not prompt_or_messages:
            raise InvalidRequestError("the prompt is empty", field="prompt")
        messages: list[Message] = [{"role": "user", "content": prompt_or_messages}]
    elif isinstance(prompt_or_messages, Sequence) and prompt_or_messages:
        messages = []
        for i, m in enumerate(prompt_or_messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise InvalidRequestError(
                    f"messages[{i}] must be a mapping with a string 'role'", field=f"messages[{i}]"
                )
            messages.append(dict(m))
    else:
        raise InvalidRequestError(
            "give a prompt string or a non-empty list of chat messages", field="prompt_or_messages"
        )
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    return messages


def arguments_text(arguments: Any) -> str:
    """Tool-call arguments as JSON text (OpenAI sends text; some servers send objects)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
