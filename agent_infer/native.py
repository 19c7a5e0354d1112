"""Access to the C++ extension ``agent_infer._native`` with an error that says how to build it."""

from __future__ import annotations

from types import ModuleType
from typing import Any

from agent_infer.errors import NativeExtensionMissingError

_BUILD_HINT = (
    "build it with `make native` (or `pip install --no-build-isolation -e .` inside the project's "
    ".venv); it needs a C++17 compiler, CMake >= 3.18, scikit-build-core and nanobind"
)


def load_native() -> ModuleType:
    """Return the compiled extension module, or raise NativeExtensionMissingError explaining the fix."""
    try:
        from agent_infer import _native
    except ImportError as exc:
        raise NativeExtensionMissingError(
            f"the C++ extension agent_infer._native is not available ({exc}); {_BUILD_HINT}"
        ) from exc
    return _native


def require_native(feature: str, attribute: str) -> object:
    """Return ``_native.<attribute>`` for ``feature``; raise if the extension lacks it (stale build)."""
    module = load_native()
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise NativeExtensionMissingError(
            f"{feature} needs agent_infer._native.{attribute}, which this build lacks (a stale build?); "
            + _BUILD_HINT
        ) from None


_OPTIONAL: dict[str, Any] = {}


def optional_native(attribute: str) -> Any:
    """``_native.<attribute>`` for a fast path with a Python fallback: False when the extension (or
    that attribute in it) is missing. Looked up once per process."""
    found = _OPTIONAL.get(attribute)
    if found is None:
        try:
            found = getattr(load_native(), attribute, False)
        except NativeExtensionMissingError:
            found = False
        _OPTIONAL[attribute] = found
    return found
