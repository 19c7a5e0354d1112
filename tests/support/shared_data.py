"""Where the shared evaluation data lives (``../shared/data`` beside the repository), found in one place.

A test that needs a data set asks for it through :func:`require_shared_data`. Outside CI a missing
data set skips the test; in CI (``CI=true``) it fails the run, so a checkout without the data
cannot pass silently.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def in_ci() -> bool:
    """True when the run is a CI run (``CI=true``), where missing data is an error."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require_shared_data(name: str) -> Path:
    """The folder ``name`` under the shared data; skips (fails in CI) the calling test when it is missing."""
    path = SHARED_DATA / name
    if not path.exists():
        message = f"shared data set {name!r} not found at {path}"
        if in_ci():
            pytest.fail(message + " (CI=true: missing data fails the run)", pytrace=False)
        pytest.skip(message)
    return path
