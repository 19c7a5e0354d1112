"""Argument checks of the grammar matcher API: typed errors that name the argument."""

from __future__ import annotations

import operator
from typing import Any

from agent_infer.errors import MatcherUsageError, TokenBitmaskError


def int_argument(value: Any, argument: str) -> int:
    """``value`` as an int (ints and integer scalars such as numpy's; not bools or floats)."""
    if isinstance(value, bool):
        raise MatcherUsageError(f"{argument} must be an int, got a bool", argument=argument)
    try:
        return operator.index(value)
    except TypeError:
        raise MatcherUsageError(
            f"{argument} must be an int, got {type(value).__name__} {value!r}", argument=argument
        ) from None


def int32(value: int, argument: str, outside: str) -> int:
    """``value`` if the native int32 argument can hold it, else a MatcherUsageError naming it."""
    if -(2**31) <= value < 2**31:
        return value
    raise MatcherUsageError(f"{argument} {value} is {outside}", argument=argument)


def row_index(value: Any, argument: str) -> int:
    """A bitmask row index as an int; anything else is a TokenBitmaskError naming ``argument``."""
    if isinstance(value, bool):
        raise TokenBitmaskError(f"{argument} must be an int row index, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TokenBitmaskError(
            f"{argument} must be an int row index, got {type(value).__name__} {value!r}"
        ) from None


def text_bytes(text: Any, argument: str) -> bytes:
    """UTF-8 bytes of ``text`` (str, or bytes-like); typed errors for lone surrogates and other types."""
    if isinstance(text, str):
        try:
            return text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise MatcherUsageError(
                f"{argument} is not valid Unicode: {text[exc.start : exc.end]!r} at character {exc.start} "
                "is a lone surrogate",
                argument=argument,
            ) from None
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    raise MatcherUsageError(f"{argument} must be str or bytes, got {type(text).__name__}", argument=argument)


def batch_rows(indices: Any) -> list[int]:
    """Row indices of a batch fill as ints (the native side checks them against the bitmask)."""
    if isinstance(indices, (str, bytes)) or not hasattr(indices, "__iter__"):
        raise TokenBitmaskError(f"indices must be a sequence of ints, got {type(indices).__name__}")
    rows = [row_index(value, f"indices[{i}]") for i, value in enumerate(indices)]
    for i, row in enumerate(rows):
        if not -(2**63) <= row < 2**63:
            raise TokenBitmaskError(f"indices[{i}] = {row} is outside the bitmask")
    return rows
