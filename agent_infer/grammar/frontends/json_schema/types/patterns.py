"""``pattern`` keywords: their values read from a schema, and the ECMA regex as the expression of
the strings containing a match (decoded, or JSON-encoded), with regex errors as schema errors."""

from __future__ import annotations

import functools
from typing import Any

from agent_infer.errors import (
    GrammarLimitError,
    GrammarSyntaxError,
    InvalidSchemaError,
    UnsupportedRegexError,
    UnsupportedSchemaError,
)
from agent_infer.grammar.common.memo import register_cache
from agent_infer.grammar.frontends.json_schema.types.string_encoding import encode_expr
from agent_infer.grammar.frontends.regex.search import regex_search_expr
from agent_infer.grammar.ir import Expr


def string_patterns(flat: dict[str, Any], pointer: str) -> list[str]:
    """The ``pattern`` values of ``flat`` (one, or the ``__patterns`` an ``allOf`` merge collected),
    each checked to be a string."""
    p = flat.get("pattern")
    if p is None:
        return []
    pats = p["__patterns"] if isinstance(p, dict) and "__patterns" in p else [p]
    for x in pats:
        if not isinstance(x, str):
            raise InvalidSchemaError("pattern must be a string", pointer=f"{pointer}/pattern")
    return list(pats)


@functools.lru_cache(maxsize=1024)
def _encoded_search(pattern: str) -> Expr:
    """The JSON encoding of the strings containing a match of ``pattern`` (errors propagate uncached)."""
    return encode_expr(regex_search_expr(pattern, dialect="ecma"))


def pattern_search(pattern: str, pointer: str, *, encoded: bool = False) -> Expr:
    """The strings containing a match of ``pattern`` (JSON-encoded when ``encoded``), with the
    regex's errors as schema errors that name ``pointer``."""
    try:
        return _encoded_search(pattern) if encoded else regex_search_expr(pattern, dialect="ecma")
    except UnsupportedRegexError as exc:
        raise UnsupportedSchemaError(
            f"pattern {pattern!r}: {exc}", keyword="pattern", pointer=pointer
        ) from exc
    except GrammarSyntaxError as exc:
        raise InvalidSchemaError(f"pattern {pattern!r} is not a valid regex: {exc}", pointer=pointer) from exc
    except GrammarLimitError as exc:
        # The regex names its position; the pointer says which pattern.
        raise GrammarLimitError(f"{exc} (at {pointer or '/'})") from exc


register_cache(_encoded_search)
