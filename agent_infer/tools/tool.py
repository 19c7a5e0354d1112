"""The :class:`Tool`: a callable the model may invoke, built from a typed function, a spec or an
OpenAI tool dict; the ``@tool`` decorator and :func:`as_tools`."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, overload

import pydantic

from agent_infer.docstrings import parse_docstring
from agent_infer.errors import InvalidRequestError
from agent_infer.tools.context import RunContext
from agent_infer.tools.errors import ToolArgumentsError, ToolDefinitionError
from agent_infer.tools.schema import (
    _clean_schema,
    _is_async,
    _note_any_json,
    _signature_model,
    no_json_form_path,
    warn_any_json,
)

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule; also keeps names safe inside every format
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


# --- the Tool --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    """A callable the model may invoke: name, description, JSON Schema ``parameters`` and the function."""

    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    is_async: bool = False
    strict: bool = True
    _model: type[pydantic.BaseModel] | None = field(default=None, compare=False, repr=False)
    #: The ``RunContext[...]`` annotation of the function's first parameter; None when it takes none.
    context_type: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ToolDefinitionError(
                f"invalid tool name {self.name!r}: use 1-64 letters, digits, '_' or '-'"
            )
        if not isinstance(self.parameters, dict) or self.parameters.get("type", "object") != "object":
            raise ToolDefinitionError(f"tool {self.name!r}: parameters must be a JSON Schema of type object")

    @classmethod
    def from_function(
        cls,
        func: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        strict: bool = True,
    ) -> Tool:
        """Build a tool from a typed function; the docstring supplies the descriptions."""
        if not callable(func):
            raise ToolDefinitionError(f"a tool must be a callable, got {type(func).__name__}")
        tool_name = str(name or getattr(func, "__name__", ""))
        summary, param_docs = parse_docstring(inspect.getdoc(func))
        model, context_type = _signature_model(func, tool_name, param_docs)
        try:
            raw_schema = model.model_json_schema()
        except pydantic.errors.PydanticUserError as exc:  # e.g. a Callable parameter has no JSON form
            path = no_json_form_path(model)
            raise ToolDefinitionError(
                f"tool {tool_name!r}: parameter {path!r} has no JSON Schema form: {exc.message}",
                field=f"{tool_name}.{path}" if path else tool_name,
            ) from exc
        schema = _clean_schema(raw_schema, close=strict)
        schema.setdefault("properties", {})
        if warn_any_json(schema, f"tool {tool_name!r}"):
            _note_any_json(schema)
        return cls(
            name=tool_name,
            description=summary if description is None else description,
            parameters=schema,
            function=func,
            is_async=_is_async(func),
            strict=strict,
            _model=model,
            context_type=context_type,
        )

    @classmethod
    def from_openai(cls, spec: Mapping[str, Any]) -> Tool:
        """A tool from an OpenAI ``{"type": "function", "function": {...}}`` spec (no callable).

        A missing ``strict`` means False, as in OpenAI's API: unenforceable schema keywords are
        then skipped (with a grammar warning) instead of raising.
        """
        inner = spec.get("function", spec) if spec.get("type", "function") == "function" else None
        if not isinstance(inner, Mapping) or "name" not in inner:
            raise ToolDefinitionError(f"not an OpenAI function tool spec: {dict(spec)!r}")
        return cls(
            name=inner["name"],
            description=inner.get("description", "") or "",
            parameters=dict(inner.get("parameters") or _EMPTY_PARAMETERS),
            strict=bool(inner.get("strict", False)),  # OpenAI's default: best effort unless asked
        )

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI chat-completions ``tools`` entry for this tool."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
                "strict": self.strict,
            },
        }

    def validate_arguments(self, arguments: Mapping[str, Any] | str) -> dict[str, Any]:
        """Check ``arguments`` (a dict or JSON text) against the parameters; returns them as Python values.

        For function tools the values are Pydantic-converted (nested models become instances,
        defaults are filled in). Raises :class:`ToolArgumentsError` listing every problem.
        """
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                raise ToolArgumentsError(
                    f"arguments of {self.name!r} are not valid JSON: {exc}",
                    tool=self.name,
                    errors=[{"type": "json_invalid", "loc": (), "msg": str(exc)}],
                ) from exc
        if not isinstance(arguments, Mapping):
            raise ToolArgumentsError(
                f"arguments of {self.name!r} must be a JSON object, got {type(arguments).__name__}",
                tool=self.name,
                errors=[{"type": "dict_type", "loc": (), "msg": "not an object"}],
            )
        if self._model is None:
            return _validate_with_schema(self.name, self.parameters, dict(arguments))
        try:
            validated = self._model.model_validate(dict(arguments))
        except pydantic.ValidationError as exc:
            errors = [dict(e) for e in exc.errors(include_url=False)]
            raise ToolArgumentsError(
                f"invalid arguments for tool {self.name!r}: {_describe(errors)}",
                tool=self.name,
                errors=errors,
            ) from exc
        return {key: getattr(validated, key) for key in type(validated).model_fields}

    def _bound(self, context: RunContext[Any] | None) -> Callable[..., Any]:
        """The function, with ``context`` bound to its ``RunContext`` parameter when it has one.

        A tool that asks for a context and is invoked without one gets ``RunContext(deps=None)``, the
        same as ``Client.run`` without ``deps=``.
        """
        func = self._callable()
        if self.context_type is None:
            return func
        ctx = context if context is not None else RunContext(None, self.name)
        return functools.partial(func, ctx)

    def invoke(self, arguments: Mapping[str, Any] | str, context: RunContext[Any] | None = None) -> Any:
        """Validate ``arguments`` and call the function (passed ``context`` if it takes a ``RunContext``).

        An async tool runs in a fresh event loop: in this thread, or in a worker thread when this
        thread already runs a loop (a sync client called from async code).
        """
        kwargs = self.validate_arguments(arguments)
        func = self._bound(context)
        if self.is_async:
            try:
                asyncio.get_running_loop()
            except RuntimeError:
                return asyncio.run(func(**kwargs))
            # This thread already runs an event loop (Jupyter, an async web handler): it cannot run
            # a second one, and waiting here on a task of that loop would deadlock it. The
            # coroutine gets its own loop in a worker thread.
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tool-{self.name}") as pool:
                return pool.submit(asyncio.run, func(**kwargs)).result()
        return func(**kwargs)

    async def ainvoke(
        self, arguments: Mapping[str, Any] | str, context: RunContext[Any] | None = None
    ) -> Any:
        """Validate and call from async code; a sync function runs in a worker thread so the loop keeps going."""
        kwargs = self.validate_arguments(arguments)
        func = self._bound(context)
        if self.is_async:
            return await func(**kwargs)
        return await asyncio.to_thread(func, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the wrapped function directly, so ``@tool`` leaves the function usable as before."""
        return self._callable()(*args, **kwargs)

    def _callable(self) -> Callable[..., Any]:
        if self.function is None:
            raise InvalidRequestError(
                f"tool {self.name!r} was defined from a spec and has no function to call"
            )
        return self.function


def _describe(errors: list[dict[str, Any]]) -> str:
    return "; ".join(f"{'.'.join(str(x) for x in e['loc']) or '<root>'}: {e['msg']}" for e in errors)


def _validate_with_schema(name: str, schema: dict[str, Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """Spec-only tools: validate with ``jsonschema`` when installed, else with our own schema compiler."""
    try:
        import jsonschema
    except ImportError:
        from agent_infer.grammar.ir import Grammar
        from agent_infer.grammar.ir.recognizer import ReferenceRecognizer

        grammar = Grammar.from_json_schema(schema, strict=False, whitespace="compact")
        if not ReferenceRecognizer(grammar).accepts(
            json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)
        ):
            raise ToolArgumentsError(
                f"invalid arguments for tool {name!r}: they do not match its parameters schema",
                tool=name,
                errors=[{"type": "schema", "loc": (), "msg": "does not match the parameters schema"}],
            ) from None
        return arguments
    validator = jsonschema.Draft202012Validator(schema)
    problems = sorted(validator.iter_errors(arguments), key=lambda e: list(e.absolute_path))
    if problems:
        errors = [{"type": e.validator, "loc": tuple(e.absolute_path), "msg": e.message} for e in problems]
        raise ToolArgumentsError(
            f"invalid arguments for tool {name!r}: {_describe(errors)}", tool=name, errors=errors
        )
    return arguments


@overload
def tool(func: Callable[..., Any], /) -> Tool: ...
@overload
def tool(
    *, name: str | None = None, description: str | None = None, strict: bool = True
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    func: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    strict: bool = True,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Decorator: ``@tool`` or ``@tool(name=..., description=..., strict=...)`` makes a :class:`Tool`."""
    if func is not None:
        return Tool.from_function(func, name=name, description=description, strict=strict)

    def wrap(f: Callable[..., Any]) -> Tool:
        return Tool.from_function(f, name=name, description=description, strict=strict)

    return wrap


def as_tools(items: Iterable[Tool | Callable[..., Any] | Mapping[str, Any]] | None) -> list[Tool]:
    """Normalize callables, Tools and OpenAI dicts to a list of Tools; duplicate names are an error."""
    tools: list[Tool] = []
    seen: set[str] = set()
    for item in items or ():
        if isinstance(item, Tool):
            t = item
        elif isinstance(item, Mapping):
            t = Tool.from_openai(item)
        elif callable(item):
            t = Tool.from_function(item)
        else:
            raise ToolDefinitionError(f"cannot make a tool from {type(item).__name__}")
        if t.name in seen:
            raise ToolDefinitionError(f"two tools are named {t.name!r}; tool names must be unique")
        seen.add(t.name)
        tools.append(t)
    return tools
