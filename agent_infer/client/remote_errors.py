"""An error answered by an agent-infer server, raised as the typed error the same mistake raises locally.

The server answers OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, and its
``code`` says which typed error it came from (``invalid_schema``, ``unsupported_schema``,
``grammar_syntax``, ``grammar_limit``, ...). Where the error says *where* the problem is (JSON
pointer, keyword, line and column, position), the location is read from the error's own fields
when the server sends them, else from the end of the message, which carries the local error's
text. Every typed error raised here also has ``status`` and ``body``, like :class:`RemoteError`.
Errors without such a code (authentication, a missing model, server failures) stay
:class:`RemoteError`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from agent_infer.errors import (
    AgentInferError,
    GrammarDefinitionError,
    GrammarError,
    GrammarLimitError,
    GrammarSyntaxError,
    InvalidRequestError,
    InvalidSchemaError,
    PromptTooLongError,
    RemoteError,
    UnsupportedRegexError,
    UnsupportedSchemaError,
)

_UNSUPPORTED_AT = re.compile(r"\s*\(keyword '(?P<keyword>(?:[^'\\]|\\.)*)' at (?P<pointer>[^)]*)\)\s*$")
_INVALID_AT = re.compile(r"\s*\(at (?P<pointer>[^)]*)\)\s*$")
_LINE_COLUMN = re.compile(r"\s*\(line (?P<line>\d+)(?:, column (?P<column>\d+))?\)\s*$")
_POSITION = re.compile(r"\s*\(position (?P<position>\d+)\)\s*$")
# constraint_failed: the engine's message names the typed error that ended the request.
_NAMED = re.compile(r"\b([A-Za-z]+Error): ")
_BY_NAME: dict[str, type[AgentInferError]] = {
    cls.__name__: cls
    for cls in (
        GrammarLimitError,
        GrammarError,
        GrammarSyntaxError,
        GrammarDefinitionError,
        UnsupportedRegexError,
        InvalidSchemaError,
        UnsupportedSchemaError,
        InvalidRequestError,
        PromptTooLongError,
    )
}


_CODES = {
    "UnsupportedSchemaError": "unsupported_schema",
    "InvalidSchemaError": "invalid_schema",
    "GrammarSyntaxError": "grammar_syntax",
    "UnsupportedRegexError": "unsupported_regex",
    "GrammarLimitError": "grammar_limit",
}


def typed_remote_error(status: int, text: str) -> AgentInferError:
    """The error to raise for an HTTP error reply: the local typed error when the code names one."""
    fallback = RemoteError("the server rejected the request", status=status, body=text)
    error = _error_object(text)
    if error is None or status >= 500 or error.get("type") == "server_error":
        return fallback
    message = str(error.get("message") or "")
    code = error.get("code")
    param = error.get("param") if isinstance(error.get("param"), str) else None
    typed = _typed(code, message, param if status == 400 else None, error)
    if typed is None:
        return fallback
    typed.status = status  # type: ignore[attr-defined]
    typed.body = text  # type: ignore[attr-defined]
    typed.__cause__ = fallback
    return typed


def _error_object(text: str) -> Mapping[str, Any] | None:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    error = data.get("error") if isinstance(data, Mapping) else None
    return error if isinstance(error, Mapping) else None


def _typed(code: Any, message: str, param: str | None, error: Mapping[str, Any]) -> AgentInferError | None:
    if code == "unsupported_schema":
        m = _UNSUPPORTED_AT.search(message)
        keyword = error.get("keyword") or (m["keyword"] if m else "")
        pointer = error.get("pointer") or (m["pointer"] if m else "")
        return UnsupportedSchemaError(_strip(message, m), keyword=str(keyword), pointer=_root(str(pointer)))
    if code == "invalid_schema":
        m = _INVALID_AT.search(message)
        pointer = error.get("pointer") or (m["pointer"] if m else "")
        return InvalidSchemaError(_strip(message, m), pointer=_root(str(pointer)))
    if code == "grammar_syntax":
        return _syntax_error(GrammarSyntaxError, message, error)
    if code == "unsupported_regex":
        return _syntax_error(UnsupportedRegexError, message, error)
    if code == "grammar_limit":
        return GrammarLimitError(message)
    if code == "invalid_constraint":
        return GrammarError(message)
    if code == "constraint_failed":
        named = [n for n in _NAMED.findall(message) if n in _BY_NAME]
        if named and named[-1] in _CODES:
            return _typed(_CODES[named[-1]], message, param, error)
        cls = _BY_NAME[named[-1]] if named else GrammarError
        return cls(message, field=param) if issubclass(cls, InvalidRequestError) else cls(message)
    if param is not None:  # a 400 naming a request field: the argument check a local call makes
        return InvalidRequestError(message, field=param)
    return None


def _syntax_error(
    cls: type[GrammarSyntaxError], message: str, error: Mapping[str, Any]
) -> GrammarSyntaxError:
    line, column, position = error.get("line"), error.get("column"), error.get("position")
    m = _LINE_COLUMN.search(message) or _POSITION.search(message)
    if m is not None and line is None and position is None:
        found = m.groupdict()
        line, column, position = found.get("line"), found.get("column"), found.get("position")
    return cls(
        _strip(message, m),
        line=_int(line),
        column=_int(column),
        position=_int(position),
    )


def _strip(message: str, match: re.Match[str] | None) -> str:
    """The message without its location suffix (the typed error appends its own)."""
    return message[: match.start()] if match is not None else message


def _root(pointer: str) -> str:
    return "" if pointer == "/" else pointer


def _int(value: Any) -> int | None:
    return int(value) if value is not None else None
