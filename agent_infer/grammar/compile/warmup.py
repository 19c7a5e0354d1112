"""The warm-up of a tokenizer's token-class tables for the JSON string contents most schemas reach.

The mask of a string-content state is a walk of the whole vocabulary (about 1.5 ms for 129k
tokens), cached in the tokenizer's native tables and shared by every grammar with the same string
syntax and follow bytes. Computing it once per tokenizer for the common cases (strings followed by
``,`` / ``}`` / ``]`` or the end, free object keys) takes it off the first decoding steps of the
first schemas, as llguidance's precomputed "slices" do; schemas with other string syntaxes compute
theirs on first use. :class:`~agent_infer.grammar.compile.compiler.GrammarCompiler` runs it when it
is built for a tokenizer that has not been warmed yet.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from agent_infer.grammar.ir import Grammar
from agent_infer.native import load_native

if TYPE_CHECKING:
    from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo

_STR: dict[str, Any] = {"type": "string"}
# (schema, document prefixes ending inside a string) whose string contents are precomputed: the
# shared string rule's follow set (what the region walk depends on) is every subset of , } ]
# that objects and arrays produce, or the end of the document; plus free object keys.
STRING_CONTEXTS: tuple[tuple[dict[str, Any], tuple[str, ...]], ...] = (
    (_STR, ('"',)),
    ({"type": "array", "items": _STR}, ('["',)),
    (
        {"type": "object", "properties": {"a": _STR}, "required": ["a"], "additionalProperties": False},
        ('{"a":"',),
    ),
    (
        {
            "type": "object",
            "properties": {"a": _STR, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
        ('{"a":"',),
    ),
    (
        {"type": "object", "properties": {"a": _STR, "b": _STR}, "required": ["a"]},
        ('{"a":"', '{"a":"x","', '{"a":"x","c', '{"a":"x","c":"'),
    ),
    ({"type": "object", "properties": {"a": _STR, "b": {"type": "array", "items": _STR}}}, ('{"a":"',)),
    (
        {"type": "array", "items": {"type": "object", "properties": {"a": _STR}}},
        ('[{"a":"', '[{"a":"x"},{"a":"'),
    ),
)

_LOCK = threading.Lock()
_WARMED: weakref.WeakSet[TokenizerInfo] = weakref.WeakSet()


def warm_string_contents(info: TokenizerInfo, compile_native: Callable[[Grammar], Any]) -> None:
    """Fill ``info``'s native tables for :data:`STRING_CONTEXTS`, once per tokenizer.

    ``compile_native`` compiles a grammar for ``info`` with the default limits and no cache, and
    returns the native compiled grammar; each context's prefixes are accepted by a native matcher
    that then fills one mask row.
    """
    with _LOCK:
        if info in _WARMED:
            return
        _WARMED.add(info)
    native = load_native()
    row = np.zeros((1, (info.vocab_size + 31) // 32), dtype=np.int32)
    for schema, prefixes in STRING_CONTEXTS:
        compiled = compile_native(Grammar.from_json_schema(schema, whitespace="compact"))
        for prefix in prefixes:
            matcher = native.GrammarMatcher(compiled, False, -1)
            if matcher.accept_bytes(prefix.encode("utf-8")):
                matcher.fill_next_token_bitmask(row, 0)
