"""Retries of remote calls: which failures are worth another try, and how long to wait before it.

A rate limit (429), a server that is overloaded or restarting (5xx, 408) and a connection that
failed or timed out are transient; anything else (a 4xx about the request) would fail the same
way again and is raised at once. Waits grow exponentially from ``backoff`` (with a little
jitter so that many clients do not retry in step), honour a ``Retry-After`` header given in
seconds, and never exceed ``max_wait``.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass

from agent_infer.errors import ConfigError

#: HTTP statuses retried: request timeout, rate limit, and the server-side failures.
RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


@dataclass(frozen=True)
class RetryPolicy:
    """``retries`` further attempts after the first, waiting ``backoff * 2**n`` seconds (at most ``max_wait``)."""

    retries: int = 2
    backoff: float = 0.5
    max_wait: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.retries, bool) or not isinstance(self.retries, int) or self.retries < 0:
            raise ConfigError(f"http_retries must be a non-negative integer, got {self.retries!r}")
        for name, value in (("http_backoff", self.backoff), ("max_wait", self.max_wait)):
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
                raise ConfigError(f"{name} must be a non-negative number of seconds, got {value!r}")

    @property
    def attempts(self) -> int:
        """The most requests one call makes."""
        return self.retries + 1

    def wait(self, attempt: int, retry_after: str | None = None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (0-based)."""
        delay = self.backoff * 2**attempt * random.uniform(1.0, 1.25)
        if retry_after is not None:
            # An HTTP date is not parsed: the exponential wait stands.
            with contextlib.suppress(ValueError):
                delay = max(delay, float(retry_after))
        return min(delay, self.max_wait)
