"""A tool's parameters as JSON Schema: the signature model, schema clean-up, and the checks for
parameters that have no JSON form or accept any JSON value."""

from __future__ import annotations

import inspect
import typing
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import pydantic

from agent_infer.tools.context import _is_context
from agent_infer.tools.errors import AnyJSONWarning, ToolDefinitionError

_ANY_JSON_NOTE = "Any JSON value."


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
