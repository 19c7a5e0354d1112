"""Tools an agent can call: typed Python functions become JSON-Schema-described :class:`Tool` objects.

A plain function (sync or async) or one decorated with :func:`tool` is turned into a ``Tool``
whose ``parameters`` JSON Schema comes from the signature through Pydantic and whose description
(and per-parameter descriptions) come from the docstring (Google, numpy or Sphinx style).
How tool calls look in a model's output is the job of :mod:`agent_infer.tool_formats`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

import pydantic

from agent_infer.docstrings import parse_docstring
from agent_infer.errors import InvalidRequestError

__all__ = [
    "AnyJSONWarning",
    "RunContext",
    "Tool",
    "ToolArgumentsError",
    "ToolDefinitionError",
    "ToolRetry",
    "as_tools",
    "parse_docstring",
    "tool",
]

_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule; also keeps names safe inside every format
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolDefinitionError(InvalidRequestError):
    """A function cannot become a tool (``*args``, bad name, unsupported annotation) or tools clash."""


class ToolArgumentsError(InvalidRequestError):
    """Arguments of a tool call do not match the tool's parameters. ``errors`` lists each problem."""

    def __init__(self, message: str, *, tool: str, errors: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message, field="arguments")
        self.tool = tool
        self.errors = errors or []


class ToolRetry(Exception):
    """Raised by a tool to ask the model for a corrected call; the message is shown to the model."""


class AnyJSONWarning(UserWarning):
    """A parameter or field has no type the schema can express (no annotation, ``object``, ``Any``),
    so the model may write any JSON value there."""


_ANY_JSON_NOTE = "Any JSON value."

DepsT = TypeVar("DepsT")


@dataclass(frozen=True)
class RunContext(Generic[DepsT]):
    """What a tool that asks for it receives (pydantic-ai's ``RunContext``): annotate the tool's first
    parameter with ``RunContext[Deps]`` and it is passed the ``deps=`` of ``Client.run``.

    ``tool_name`` and ``tool_call_id`` name the call being executed, ``turn`` the model call (from 1)
    that made it. The parameter is not part of the tool's JSON schema: the model never sees it.
    """

    deps: DepsT
    tool_name: str = ""
    tool_call_id: str = ""
    turn: int = 0


def _is_context(annotation: Any) -> bool:
    return annotation is RunContext or typing.get_origin(annotation) is RunContext


def context_deps_type(annotation: Any) -> type | None:
    """The ``Deps`` of a ``RunContext[Deps]`` annotation when it is a plain class (checkable with isinstance)."""
    args = typing.get_args(annotation)
    return args[0] if len(args) == 1 and isinstance(args[0], type) and args[0] is not Any else None


# --- schemas ---------------------------------------------------------------------------------------

_DATA_KEYS = {"default", "enum", "const", "examples"}
_MAP_KEYS = {"properties", "$defs", "definitions", "patternProperties", "dependentSchemas"}


def _clean_schema(schema: Any, close: bool) -> Any:
    """Drop Pydantic's generated ``title``s (prompt tokens that say nothing new); with ``close``, give
    objects with declared properties ``additionalProperties: false`` (OpenAI's strict rule).

    Closing is safe: Pydantic drops unknown keys of nested models anyway, so forbidding them only
    stops the grammar from letting the model spend tokens on keys that would be thrown away.
    """
    if isinstance(schema, list):
        return [_clean_schema(s, close) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "title" and isinstance(value, str):
            continue
        if key in _DATA_KEYS:
            out[key] = value
        elif key in _MAP_KEYS and isinstance(value, dict):
            out[key] = {name: _clean_schema(sub, close) for name, sub in value.items()}
        else:
            out[key] = _clean_schema(value, close)
    if close and "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def no_json_form_path(model: Any) -> str | None:
    """The dotted path of the first field of ``model`` (a model class or any type, nested models
    included) that has no JSON Schema form (a ``Callable``, an arbitrary class), or None.

    Pydantic's own error names the core-schema type but not the field, which in a large model
    leaves the user guessing.
    """
    return _unschemable(model, [])


def _has_json_form(annotation: Any) -> bool:
    try:
        pydantic.TypeAdapter(annotation).json_schema()
    except Exception:  # any failure to produce a schema means "no JSON form" here
        return False
    return True


def _unschemable(annotation: Any, path: list[str]) -> str | None:
    if _has_json_form(annotation):
        return None
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        for name, info in annotation.model_fields.items():
            found = _unschemable(info.annotation, [*path, name])
            if found is not None:
                return found
    for arg in typing.get_args(annotation):
        if isinstance(arg, type) or typing.get_origin(arg) is not None:
            found = _unschemable(arg, path)
            if found is not None:
                return found
    return ".".join(path) or None


def any_json_pointers(schema: Any, pointer: str = "") -> list[str]:
    """JSON pointers of the properties and items of ``schema`` that accept any JSON value.

    A generated schema has such a spot when a field was typed ``object``/``Any`` or a parameter had
    no annotation: nothing constrains what the model writes there.
    """
    found: list[str] = []
    if not isinstance(schema, dict):
        return found
    for key in ("properties", "$defs"):
        for name, sub in (schema.get(key) or {}).items():
            where = f"{pointer}/{key}/{_escape(name)}"
            found += [where] if key == "properties" and _is_any(sub) else any_json_pointers(sub, where)
    for key in ("items", "additionalProperties"):
        sub = schema.get(key)
        if isinstance(sub, dict):
            found += [f"{pointer}/{key}"] if _is_any(sub) else any_json_pointers(sub, f"{pointer}/{key}")
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for i, sub in enumerate(schema.get(key) or []):
            found += any_json_pointers(sub, f"{pointer}/{key}/{i}")
    return found


def _is_any(schema: Any) -> bool:
    return isinstance(schema, dict) and not set(schema) - {"description", "default", "title", "examples"}


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


def warn_any_json(schema: Any, what: str) -> list[str]:
    """Warn (:class:`AnyJSONWarning`) about every any-JSON spot of a generated schema; returns the pointers."""
    pointers = any_json_pointers(schema)
    if pointers:
        warnings.warn(
            f"{what}: {', '.join(pointers)} accept(s) any JSON value (no type, 'object' or 'Any'); "
            "annotate a concrete type to constrain the output",
            AnyJSONWarning,
            stacklevel=3,
        )
    return pointers


def _note_any_json(schema: dict[str, Any]) -> None:
    """Say in the parameter's own description that it takes any JSON value, so the model knows too."""
    for name, sub in (schema.get("properties") or {}).items():
        if _is_any(sub):
            text = sub.get("description")
            schema["properties"][name] = {
                **sub,
                "description": f"{text} {_ANY_JSON_NOTE}" if text else _ANY_JSON_NOTE,
            }


def _signature_model(
    func: Callable[..., Any], name: str, descriptions: Mapping[str, str]
) -> tuple[type[pydantic.BaseModel], Any]:
    """The arguments model of ``func`` and the ``RunContext`` annotation of its first parameter (or None)."""
    try:
        hints = typing.get_type_hints(func, include_extras=True)
    except Exception as exc:  # unresolvable forward references: name the function
        raise ToolDefinitionError(f"cannot resolve the type hints of tool {name!r}: {exc}") from exc
    fields: dict[str, Any] = {}
    context: Any = None
    for index, param in enumerate(inspect.signature(func).parameters.values()):
        if _is_context(hints.get(param.name)):
            if index != 0 or param.kind == param.KEYWORD_ONLY:
                raise ToolDefinitionError(
                    f"tool {name!r}: the RunContext parameter {param.name!r} must be the first "
                    "positional parameter"
                )
            context = hints[param.name]
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            star = "*" if param.kind == param.VAR_POSITIONAL else "**"
            raise ToolDefinitionError(
                f"tool {name!r}: parameter {star}{param.name} cannot be described to a model; "
                "list each argument explicitly"
            )
        if param.kind == param.POSITIONAL_ONLY:
            raise ToolDefinitionError(
                f"tool {name!r}: positional-only parameter {param.name!r} cannot be passed by name"
            )
        annotation = hints.get(param.name, Any)
        default = ... if param.default is inspect.Parameter.empty else param.default
        description = descriptions.get(param.name)
        if description and not _has_field_description(annotation):
            fields[param.name] = (annotation, pydantic.Field(default, description=description))
        else:
            fields[param.name] = (annotation, default)
    try:
        model = pydantic.create_model(
            f"{name}_arguments", __config__=pydantic.ConfigDict(extra="forbid"), **fields
        )
    except (pydantic.PydanticSchemaGenerationError, TypeError) as exc:
        raise ToolDefinitionError(f"tool {name!r}: unsupported parameter type: {exc}") from exc
    return model, context


def _is_async(func: Callable[..., Any]) -> bool:
    # Callable objects with an ``async def __call__`` are async tools too.
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


def _has_field_description(annotation: Any) -> bool:
    return typing.get_origin(annotation) is typing.Annotated and any(
        getattr(meta, "description", None) for meta in typing.get_args(annotation)[1:]
    )


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
