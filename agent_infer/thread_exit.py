"""Stopping daemon threads that run native code before the interpreter finalizes, and refusing
new work once exit has begun.

A daemon thread that is inside a native call with the GIL released (a torch op, a batch mask
fill) when the interpreter finalizes is ended by CPython the moment it asks for the GIL back:
``pthread_exit`` unwinds its stack, and the unwind through a C++ ``noexcept`` frame (the
destructor that re-acquires the GIL) aborts the process with ``terminate called without an
active exception`` after the program's own output. ``atexit`` callbacks run after non-daemon
threads are joined and before daemon threads are cut off, so owners of such threads register
here and stop them (between steps) in time.

Exit begins earlier than that: when the main thread ends, ``threading`` runs its own exit hooks
before it joins the non-daemon threads, and one of them (``concurrent.futures``') makes every
thread-pool executor refuse new work from then on ("cannot schedule new futures after
shutdown"). A request submitted in that window, by a thread the interpreter is still waiting
for, would fail inside the engine with that bare ``RuntimeError``. Owners that can refuse work
cleanly (:class:`RefusesAtExit`) are told first, through a ``threading`` exit hook registered
after ``concurrent.futures``' (those hooks run last-registered first), so a new request is
refused with their own typed error while work already in flight goes on.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 - its exit hook must be registered before ours
import logging
import threading
import weakref
from typing import Protocol

logger = logging.getLogger(__name__)


class StopsAtExit(Protocol):
    """An owner of a daemon thread that steps native code."""

    def stop_for_exit(self) -> None:
        """End the thread (wait for its current step) and refuse new work."""


class RefusesAtExit(StopsAtExit, Protocol):
    """An owner that also refuses new work once exit begins (before thread pools shut down)."""

    def refuse_for_exit(self) -> None:
        """Refuse new work from now on with a typed error; work in flight goes on."""


_lock = threading.Lock()
_owners: weakref.WeakSet[StopsAtExit] = weakref.WeakSet()
_hooked = False
_exiting = threading.Event()


def exiting() -> bool:
    """True once the interpreter has begun to exit (the main thread ended)."""
    return _exiting.is_set()


def stop_at_exit(owner: StopsAtExit) -> None:
    """Call ``owner.stop_for_exit()`` at interpreter exit unless it was garbage-collected before,
    and, when it has one, ``owner.refuse_for_exit()`` as exit begins."""
    global _hooked
    with _lock:
        if not _hooked:
            atexit.register(_stop_all)
            _register_refuse_hook()
            _hooked = True
        _owners.add(owner)
    refuse = getattr(owner, "refuse_for_exit", None)
    if refuse is not None and _exiting.is_set():  # registered after exit began
        refuse()


def _register_refuse_hook() -> None:
    # threading._register_atexit is CPython's hook for exactly this (concurrent.futures uses it);
    # without it (another implementation) new work is refused only by the atexit stop.
    register = getattr(threading, "_register_atexit", None)
    if register is None:
        return
    try:
        register(_refuse_all)
    except RuntimeError:  # exit has already begun: stop_at_exit refuses for its owner
        _exiting.set()


def _refuse_all() -> None:
    _exiting.set()
    with _lock:
        owners = list(_owners)
    for owner in owners:
        refuse = getattr(owner, "refuse_for_exit", None)
        if refuse is None:
            continue
        try:
            refuse()
        except Exception:  # one failing owner must not leave the others taking work
            logger.exception("refusing new work of %r at interpreter exit failed", owner)


def _stop_all() -> None:
    with _lock:
        owners = list(_owners)
    for owner in owners:
        try:
            owner.stop_for_exit()
        except Exception:  # one failing owner must not leave the others' threads running
            logger.exception("stopping %r at interpreter exit failed", owner)
