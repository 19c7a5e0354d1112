"""Pause Python's cyclic garbage collector while a grammar is built and compiled.

Building a grammar allocates tens of thousands of small container objects (IR nodes, schema
dicts, rule tuples) that all stay alive until the build ends, so every generation-0 collection
finds nothing to free, promotes them, and sooner or later a full collection traverses the whole
heap: 85-115 ms landing on whichever schema happens to be compiling (see docs/performance.md).
Reference counting still frees short-lived objects at once; the rare garbage cycle made during
a build waits for the first collection after it.

The collector is process-global, so the pause is shared: threads that compile at the same time
count as holders under one lock, the first one in disables collection (only if it was enabled)
and the last one out re-enables it. A collector the caller had disabled stays disabled; a
``gc.disable()`` issued by another thread while a pause is held cannot be told apart from the
pause itself and is undone when the last holder leaves.
"""

from __future__ import annotations

import functools
import gc
import threading
from collections.abc import Callable
from types import TracebackType
from typing import ParamSpec, TypeVar

_P = ParamSpec("_P")
_R = TypeVar("_R")


class _GcPause:
    """Re-entrant, thread-safe "collector off" scope (use the module's :data:`gc_paused`)."""

    __slots__ = ("_holders", "_lock", "_restore")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        # Whether the first holder found collection enabled, i.e. whether the last one re-enables it.
        self._restore = False

    def __enter__(self) -> None:
        with self._lock:
            if self._holders == 0:
                self._restore = gc.isenabled()
                if self._restore:
                    gc.disable()
            self._holders += 1

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._lock:
            self._holders -= 1
            if self._holders == 0 and self._restore:
                self._restore = False
                gc.enable()

    @property
    def holders(self) -> int:
        """How many scopes (over all threads) currently hold the pause."""
        return self._holders


gc_paused = _GcPause()
"""``with gc_paused:`` runs the block with cyclic collection paused (see the module docstring)."""


def pauses_gc(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """Decorator: run ``fn`` inside :data:`gc_paused`."""

    @functools.wraps(fn)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with gc_paused:
            return fn(*args, **kwargs)

    return wrapper
