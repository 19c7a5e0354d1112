"""Checks on keyword values while a schema is normalized: values of the wrong JSON type, and
numbers the front end cannot compile (non-finite, or integers past Python's int-to-str limit),
each reported with its JSON pointer; and :func:`schema_text`, the memo key of a schema or value
that holds such an integer."""

from __future__ import annotations

import json
import math
from typing import Any

from agent_infer.errors import InvalidSchemaError

_COUNTS = {
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "minContains",
    "maxContains",
}


_NUMBERS = {"minimum", "maximum", "multipleOf"}


_STRINGS = frozenset(("pattern", "format"))


# Keywords check_shape looks at, and those _walk rewrites or descends into (the rest are copied).
SHAPED_KEYWORDS = frozenset(
    (
        *_COUNTS,
        *_NUMBERS,
        "exclusiveMinimum",
        "exclusiveMaximum",
        "required",
        "enum",
        "const",
        "pattern",
        "format",
        "uniqueItems",
    )
) | {"type"}


EXCLUSIVE_KEYWORDS = frozenset(("exclusiveMinimum", "exclusiveMaximum"))


# Integers are written and compared through their decimal text (grammars, enum filtering), which
# Python refuses to produce past its default int-to-str limit: such integers are rejected, with
# the same bound whatever the interpreter's setting.
MAX_INT_DIGITS = 4300


_INT_BOUND = 10**MAX_INT_DIGITS


class TooLongInteger:
    """An integer literal of JSON schema text with more than MAX_INT_DIGITS digits (``json.loads``
    cannot convert it): kept as its text so the keyword holding it is reported with its pointer."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return f"<integer of {len(self.text.lstrip('-'))} digits>"

    def __str__(self) -> str:
        return self.text


def schema_text(value: Any, *, sort_keys: bool = False) -> str:
    """``json.dumps(value, default=str)``, the key the compiler's memos use for a schema or a
    value, also where an annotation holds an integer past Python's int-to-str limit (kept by
    validation, which only looks at the keywords that constrain)."""
    try:
        return json.dumps(value, sort_keys=sort_keys, default=str)
    except ValueError:
        return json.dumps(_hex_huge(value), sort_keys=sort_keys, default=str)


def _hex_huge(value: Any) -> Any:
    """``value`` with integers past the int-to-str limit as hex text (hex has no such limit)."""
    kind = type(value)
    if kind is int and not -_INT_BOUND < value < _INT_BOUND:
        return f"<integer 0x{value:x}>"
    if kind is list:
        return [_hex_huge(x) for x in value]
    if kind is dict:
        return {k: _hex_huge(x) for k, x in value.items()}
    return value


def number_problem(v: Any) -> str | None:
    """Why the JSON number ``v`` cannot be compiled (non-finite, too many digits), or None."""
    vt = type(v)
    if vt is float:
        return None if math.isfinite(v) else f"must be a finite number, got {v!r}"
    if vt is TooLongInteger or (vt is not bool and isinstance(v, int) and not -_INT_BOUND < v < _INT_BOUND):
        return f"is an integer with more than {MAX_INT_DIGITS} digits"
    return None


def check_value(value: Any, pointer: str, keyword: str = "enum") -> None:
    """Reject a JSON value (``enum``/``const``) holding a number :func:`number_problem` refuses,
    naming the number's own pointer. Iterative (values nest as deep as their source allows); a
    pointer is spelled out only for a container or the culprit, as enums list thousands of codes."""
    if type(value) in _PLAIN:
        return
    stack = [(value, pointer)]
    while stack:
        v, here = stack.pop()
        vt = type(v)
        if vt is list or vt is dict:
            items = enumerate(v) if vt is list else v.items()
            if vt is list and set(map(type, v)) <= _PLAIN:
                continue
            for k, x in items:
                xt = type(x)
                if xt in _PLAIN:
                    continue
                if xt is list or xt is dict or number_problem(x) is not None:
                    stack.append((x, f"{here}/{pointer_escape(str(k))}"))
        else:
            problem = number_problem(v)
            if problem is not None:
                raise InvalidSchemaError(f"{keyword} value {problem}", pointer=here)


_PLAIN = frozenset((str, bool, type(None)))


def _is_num(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def check_shape(key: str, value: Any, parent: str) -> None:
    """Reject keyword values of the wrong JSON type (InvalidSchemaError with the keyword's pointer,
    under ``parent``, the pointer of the schema holding it)."""
    vt = type(value)
    if vt is str and (key == "type" or key in _STRINGS):
        return  # the common cases, decided without the chain below
    if key == "enum" or key == "const":
        if key == "enum" and not isinstance(value, list):
            raise InvalidSchemaError("enum must be an array", pointer=f"{parent}/enum")
        if vt is not str:
            check_value(value, f"{parent}/{key}", key)
        return
    if (key in _NUMBERS or key in EXCLUSIVE_KEYWORDS or key in _COUNTS) and vt is not bool:
        # Non-finite and over-long numbers first: the checks below would convert them.
        problem = number_problem(value)
        if problem is not None:
            raise InvalidSchemaError(f"{key} {problem}", pointer=f"{parent}/{pointer_escape(key)}")
    is_num = _is_num
    problem = None
    if key in _COUNTS and not (is_num(value) and value >= 0 and value == int(value)):
        problem = "must be a non-negative integer"
    elif key in _NUMBERS and not is_num(value):
        problem = "must be a number"
    elif key == "multipleOf" and value <= 0:
        problem = "must be greater than 0"
    elif key in ("exclusiveMinimum", "exclusiveMaximum") and not (is_num(value) or isinstance(value, bool)):
        problem = "must be a number"
    elif key == "required" and not (isinstance(value, list) and all(isinstance(r, str) for r in value)):
        problem = "must be an array of strings"
    elif key in ("pattern", "format") and not isinstance(value, str):
        problem = "must be a string"
    elif key == "uniqueItems" and not isinstance(value, bool):
        problem = "must be a boolean"
    elif key == "type" and not (
        isinstance(value, str) or (isinstance(value, list) and all(isinstance(t, str) for t in value))
    ):
        problem = "must be a string or an array of strings"
    if problem:
        raise InvalidSchemaError(f"{key} {problem}", pointer=f"{parent}/{pointer_escape(key)}")


def pointer_escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")
