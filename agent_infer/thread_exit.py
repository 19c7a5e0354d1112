"""Stopping daemon threads that run native code before the interpreter finalizes.

A daemon thread that is inside a native call with the GIL released (a torch op, a batch mask
fill) when the interpreter finalizes is ended by CPython the moment it asks for the GIL back:
``pthread_exit`` unwinds its stack, and the unwind through a C++ ``noexcept`` frame (the
destructor that re-acquires the GIL) aborts the process with ``terminate called without an
active exception`` after the program's own output. ``atexit`` callbacks run after non-daemon
threads are joined and before daemon threads are cut off, so owners of such threads register
here and stop them (between steps) in time.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from typing import Protocol

logger = logging.getLogger(__name__)


class StopsAtExit(Protocol):
    """An owner of a daemon thread that steps native code."""

    def stop_for_exit(self) -> None:
        """End the thread (wait for its current step) and refuse new work."""


_lock = threading.Lock()
_owners: weakref.WeakSet[StopsAtExit] = weakref.WeakSet()
_hooked = False


def stop_at_exit(owner: StopsAtExit) -> None:
    """Call ``owner.stop_for_exit()`` at interpreter exit unless it was garbage-collected before."""
    global _hooked
    with _lock:
        if not _hooked:
            atexit.register(_stop_all)
            _hooked = True
        _owners.add(owner)


def _stop_all() -> None:
    with _lock:
        owners = list(_owners)
    for owner in owners:
        try:
            owner.stop_for_exit()
        except Exception:  # one failing owner must not leave the others' threads running
            logger.exception("stopping %r at interpreter exit failed", owner)
