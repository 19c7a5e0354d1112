"""Request bodies: read within the size limit, parse as JSON, bound the nesting, validate strictly.

Every failure here is a 400 (413 for size) in OpenAI's error shape with ``code`` saying which
check failed, so a client never sees a parser's internal error or a 500 for what it sent.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from agent_infer.server.errors import ApiError, validation_error

M = TypeVar("M", bound=BaseModel)

#: Arrays and objects may nest this many levels (the outermost object is level 1). The strict
#: validator refuses documents past ~200 levels with a message that calls them invalid JSON, and
#: Python's parser overflows its recursion limit near 1,000; below both, the limit is a 400 of
#: its own. A ``response_format`` schema sits 4 levels down, so it may nest 124 more.
MAX_BODY_DEPTH = 128

# A JSON string literal (escapes included); brackets inside strings do not nest anything.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_TOKEN = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = np.zeros(256, dtype=np.int32)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


async def read_json(request: Request, model: type[M], limit: int) -> M:
    """Read at most ``limit`` bytes of body, parse JSON, bound its nesting, validate against ``model``."""
    raw = await _read_body(request, limit)
    parse_json(raw, "request body")
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        raise validation_error(exc) from None


def parse_json(text: str | bytes, what: str, param: str | None = None) -> Any:
    """Parse JSON ``text`` nesting at most ``MAX_BODY_DEPTH`` levels; else a 400 naming ``what``.

    Used for the body and for JSON carried inside string fields (tool-call arguments, a schema
    given as text), which would otherwise reach Python's parser unbounded.
    """
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        # Only text far deeper than MAX_BODY_DEPTH gets here; the scan says where.
        _check_depth(raw, what, param, force=True)
        raise _too_deep(what, param, "") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"{what} is not valid JSON: {exc}", param=param, code="invalid_json") from None
    _check_depth(raw, what, param)
    return value


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(
            413, f"request body of {declared} bytes exceeds the limit of {limit} bytes", code="body_too_large"
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _reject_constant(name: str) -> Any:
    # Python's parser accepts NaN and Infinity; JSON (and the strict validator) does not.
    raise ValueError(f"{name} is not a JSON value")


def _check_depth(raw: bytes, what: str, param: str | None, *, force: bool = False) -> None:
    """Raise a 400 naming the line and column where ``raw`` nests past ``MAX_BODY_DEPTH``."""
    if not force:
        # No more opening brackets than the limit (strings included): it cannot nest deeper.
        if raw.count(b"[") + raw.count(b"{") <= MAX_BODY_DEPTH:
            return
        brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
        depths = np.cumsum(_STEP[np.frombuffer(brackets, dtype=np.uint8)])
        if not depths.size or int(depths.max()) <= MAX_BODY_DEPTH:
            return
    # The error path walks the tokens once more to find where the limit is crossed.
    depth = 0
    for token in _TOKEN.finditer(raw):
        first = token.group()[:1]
        if first in (b"[", b"{"):
            depth += 1
            if depth > MAX_BODY_DEPTH:
                offset = token.start()
                line = raw.count(b"\n", 0, offset) + 1
                column = offset - (raw.rfind(b"\n", 0, offset) + 1) + 1
                raise _too_deep(what, param, f" (line {line}, column {column})")
        elif first in (b"]", b"}"):
            depth -= 1


def _too_deep(what: str, param: str | None, where: str) -> ApiError:
    return ApiError(
        400,
        f"{what} nests arrays/objects deeper than the limit of {MAX_BODY_DEPTH} levels{where}",
        param=param,
        code="json_too_deep",
    )
