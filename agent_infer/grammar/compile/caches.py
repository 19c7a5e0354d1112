"""The process-wide memos of the grammar front ends, and one switch that empties them all.

Compiling a schema reuses work from earlier grammars in the same process: key tries by name set,
pattern and format automata, the serialized programs of shared rule bodies. A server gains from
that; a benchmark of cold compiles must not, so :func:`clear_grammar_caches` drops every such memo
(each is also bounded on its own). Tables that depend only on the library (Unicode classes) or
on the tokenizer (``TokenizerInfo``) are not memos of earlier grammars and stay.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, MutableMapping
from typing import Any

from agent_infer.grammar.ir.constructors import clear_literal_memo

_LOCK = threading.Lock()
_CLEARERS: list[Callable[[], None]] = []


def register_cache(cache: MutableMapping[Any, Any] | Callable[..., Any]) -> None:
    """Add a module-level dict, or a ``functools.lru_cache`` function, to what
    :func:`clear_grammar_caches` empties."""
    clear = getattr(cache, "cache_clear", None) or getattr(cache, "clear", None)
    if not callable(clear):
        raise TypeError(f"{cache!r} is neither a mapping nor an lru_cache function")
    with _LOCK:
        _CLEARERS.append(clear)


def register_clearer(clear: Callable[[], None]) -> None:
    """Add a function that empties a memo kept elsewhere (the native key-trie nodes) to what
    :func:`clear_grammar_caches` runs."""
    with _LOCK:
        _CLEARERS.append(clear)


register_clearer(clear_literal_memo)


def clear_grammar_caches() -> None:
    """Forget everything the front ends and the serializer memoised from earlier grammars, so the
    next compile runs as in a fresh process (imports aside). Safe while other threads compile:
    a memo miss only recomputes."""
    with _LOCK:
        clearers = list(_CLEARERS)
    for clear in clearers:
        clear()
    from agent_infer.native import load_native

    native = load_native()
    if hasattr(native, "clear_body_cache"):
        native.clear_body_cache()
