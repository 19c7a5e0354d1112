"""HTTP errors in OpenAI's shape, and the mapping from agent-infer's typed errors to them."""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from agent_infer.errors import (
    AgentInferError,
    GrammarError,
    GrammarLimitError,
    GrammarSyntaxError,
    InvalidRequestError,
    InvalidSchemaError,
    UnsupportedRegexError,
    UnsupportedSchemaError,
)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(AgentInferError):
    """An error answered to the client: HTTP ``status``, message, the request field (``param``)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        where: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        #: Extra response headers (``WWW-Authenticate`` on a 401).
        self.headers = headers
        #: Where a constraint's problem is, as fields of the error object (``pointer`` and
        #: ``keyword`` for schemas, ``line``/``column`` or ``position`` for grammar text), so a
        #: client need not read them out of the message.
        self.where = where or {}

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": _TYPES.get(
                    self.status, "invalid_request_error" if self.status < 500 else "server_error"
                ),
                "param": self.param,
                "code": self.code,
                **self.where,
            }
        }


def validation_error(exc: ValidationError) -> ApiError:
    """A 400 naming the first offending field of a request body (dotted path, list indices included)."""
    errors = exc.errors(include_url=False)
    # With unions pydantic reports one error per member; the deepest one is the most specific,
    # and among equally deep ones a value error (out of range) beats a type error (wrong member).
    first = max(
        errors,
        key=lambda e: (len([p for p in e["loc"] if not _is_union_tag(p)]), not e["type"].endswith("_type")),
    )
    loc = ".".join(str(p) for p in first["loc"] if not _is_union_tag(p))
    kind = first["type"]
    if kind == "json_invalid":
        # The body was parsed once already; name this the same way as that parse's failures.
        detail = str(first.get("ctx", {}).get("error") or first["msg"])
        return ApiError(400, f"request body is not valid JSON: {detail}", code="invalid_json")
    if kind == "extra_forbidden":
        message = f"unknown field {loc!r}"
    elif kind == "missing":
        message = f"missing required field {loc!r}"
    else:
        message = f"{loc}: {first['msg']}"
    return ApiError(400, message, param=loc or None, code=kind)


def _is_union_tag(part: object) -> bool:
    # Union members appear in error locations as type names ("str", "list[ContentPart]",
    # "NamedToolChoice"); request fields are lower-case names or list indices.
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part[:1].isupper())


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "literal", "dict", "list"})


def constraint_error(exc: BaseException, where: str) -> ApiError:
    """A 400 for a constraint that does not lower, naming ``where`` it came from and the schema location."""
    cause = exc.__cause__ if isinstance(exc, InvalidRequestError) and exc.__cause__ is not None else exc
    detail, code = _constraint_detail(cause)
    return ApiError(400, f"{where}: {detail}", param=where, code=code, where=_location(cause))


def _location(cause: BaseException) -> dict[str, Any]:
    """The location fields of a typed constraint error, those it has."""
    names = ("pointer", "keyword", "line", "column", "position")
    return {n: getattr(cause, n) for n in names if getattr(cause, n, None) is not None}


def _constraint_detail(cause: BaseException) -> tuple[str, str | None]:
    """What is wrong with a constraint, and the error ``code`` for that kind of problem."""
    if isinstance(cause, UnsupportedSchemaError):
        at = cause.pointer or "/"
        return f"unsupported JSON Schema keyword {cause.keyword!r} at {at}: {cause}", "unsupported_schema"
    if isinstance(cause, InvalidSchemaError):
        return f"invalid JSON Schema at {cause.pointer or '/'}: {cause}", "invalid_schema"
    if isinstance(cause, UnsupportedRegexError):
        return str(cause), "unsupported_regex"
    if isinstance(cause, GrammarSyntaxError):
        return str(cause), "grammar_syntax"
    if isinstance(cause, GrammarLimitError):
        return f"constraint too large: {cause}", "grammar_limit"
    if isinstance(cause, GrammarError):
        return f"invalid constraint: {cause}", "invalid_constraint"
    if isinstance(cause, InvalidRequestError):
        return str(cause), None
    return f"{type(cause).__name__}: {cause}", None


def request_error(exc: InvalidRequestError, constraint_field: str | None) -> ApiError:
    """Map an ``add_request`` rejection: constraint failures name the request field that carried them."""
    if exc.field == "structured" and constraint_field is not None:
        return constraint_error(exc, constraint_field)
    return ApiError(400, str(exc), param=exc.field)


# Error types that end an accepted request through the request's own fault (a constraint that
# fails to compile later, in the engine's worker pool): 400, not 500.
_CLIENT_FAULT = re.compile(
    r"\b(GrammarLimitError|GrammarError|GrammarSyntaxError|GrammarDefinitionError|UnsupportedRegexError|"
    r"InvalidSchemaError|UnsupportedSchemaError|InvalidRequestError|PromptTooLongError):"
)


def finish_error(message: str | None, constraint_field: str | None = None) -> ApiError:
    """The error for a request the engine ended with ``finish_reason == "error"``."""
    text = message or "the engine failed this request"
    if _CLIENT_FAULT.search(text):
        where = f"{constraint_field}: " if constraint_field else ""
        return ApiError(
            400, f"{where}the constraint failed: {text}", param=constraint_field, code="constraint_failed"
        )
    return ApiError(500, f"generation failed: {text}", code="engine_error")
