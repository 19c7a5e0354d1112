"""The registry of process-wide memos that the grammar stages keep across grammars.

Compiling a schema reuses work from earlier grammars in the same process: key tries by name set,
pattern and format automata, the serialized programs of shared rule bodies. Each stage registers
its memo here when its module is imported; :func:`agent_infer.grammar.compile.caches.clear_grammar_caches`
empties all of them. The registry sits below every stage so that a front end can register a memo
without importing the compiler.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, MutableMapping
from typing import Any

_LOCK = threading.Lock()
_CLEARERS: list[Callable[[], None]] = []


def register_cache(cache: MutableMapping[Any, Any] | Callable[..., Any]) -> None:
    """Add a module-level dict, or a ``functools.lru_cache`` function, to what
    ``clear_grammar_caches`` empties."""
    clear = getattr(cache, "cache_clear", None) or getattr(cache, "clear", None)
    if not callable(clear):
        raise TypeError(f"{cache!r} is neither a mapping nor an lru_cache function")
    register_clearer(clear)


def register_clearer(clear: Callable[[], None]) -> None:
    """Add a function that empties a memo kept elsewhere (the native key-trie nodes) to what
    ``clear_grammar_caches`` runs."""
    with _LOCK:
        _CLEARERS.append(clear)


def clear_registered() -> None:
    """Run every registered clearer (a snapshot of the list: registering while clearing is safe)."""
    with _LOCK:
        clearers = list(_CLEARERS)
    for clear in clearers:
        clear()
