"""Helpers shared by engine tests."""

from __future__ import annotations

from typing import Any


def drain(engine: Any) -> dict[str, Any]:
    """Step ``engine`` until no request is left; the finished outputs by request id."""
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def simulate_step(sched: Any, out: Any, next_token: int = 7) -> None:
    """Advance ``sched`` past the step ``out`` as the engine would, without a model: computed tokens
    grow and every sequence whose chunk reached its end gains ``next_token``."""
    sched.advance(out)
    for item in out.scheduled:
        if item.samples:
            item.seq.append_token(next_token)
