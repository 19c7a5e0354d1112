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
