"""Access to the C++ extension ``agent_infer._native`` with an error that says how to build it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from agent_infer import envs
from agent_infer.errors import ConfigError, NativeExtensionMissingError

_BUILD_HINT = (
    "build it with `make native` (or `pip install --no-build-isolation -e .` inside the project's "
    ".venv); it needs a C++17 compiler, CMake >= 3.18, scikit-build-core and nanobind"
)


def load_native() -> ModuleType:
    """Return the compiled extension module, or raise NativeExtensionMissingError explaining the fix.

    With ``AGENT_INFER_NATIVE_LIBRARY`` set, the first call loads that file as ``agent_infer._native``.
    """
    loaded = sys.modules.get("agent_infer._native")
    if loaded is not None:
        return loaded
    override = envs.native_library()
    if override is not None:
        return _load_from_file(override)
    try:
        from agent_infer import _native
    except ImportError as exc:
        raise NativeExtensionMissingError(
            f"the C++ extension agent_infer._native is not available ({exc}); {_BUILD_HINT}"
        ) from exc
    return _native


def _load_from_file(path: Path) -> ModuleType:
    """Register the extension at ``path`` as ``agent_infer._native``, so every later import (including
    ``from agent_infer import _native``) gets this one and never a second copy of the extension."""
    if not path.is_file():
        raise ConfigError(f"AGENT_INFER_NATIVE_LIBRARY={str(path)!r} is not a file")
    spec = importlib.util.spec_from_file_location("agent_infer._native", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"AGENT_INFER_NATIVE_LIBRARY={str(path)!r} is not an extension module")
    try:
        # For an extension module, module_from_spec is where the file is dlopen'ed.
        module = importlib.util.module_from_spec(spec)
        sys.modules["agent_infer._native"] = module
        spec.loader.exec_module(module)
    except ImportError as exc:
        sys.modules.pop("agent_infer._native", None)
        raise NativeExtensionMissingError(
            f"AGENT_INFER_NATIVE_LIBRARY={str(path)!r} failed to import ({exc}); {_BUILD_HINT}"
        ) from exc
    import agent_infer

    agent_infer._native = module
    return module


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
