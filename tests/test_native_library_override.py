"""``AGENT_INFER_NATIVE_LIBRARY``: loading a separately built extension (``make test-asan``'s)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from agent_infer.errors import ConfigError, NativeExtensionMissingError

_PROBE = """
import sys
from agent_infer.native import load_native
module = load_native()
from agent_infer import _native  # the way the model code imports it
from agent_infer.grammar import Grammar, GrammarCompiler, TokenizerInfo
GrammarCompiler(TokenizerInfo.bytes_only()).compile(Grammar.from_regex("a+"))
print(module.__file__, _native is module, sys.modules["agent_infer._native"] is module)
"""


def _run(code: str, library: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, AGENT_INFER_NATIVE_LIBRARY=library)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_override_is_the_only_copy_every_import_gets(tmp_path: pytest.TempPathFactory) -> None:
    from agent_infer import _native

    # A copy at another path: proves the file named by the variable is loaded, not the installed one.
    copy = os.path.join(str(tmp_path), os.path.basename(_native.__file__))
    with open(_native.__file__, "rb") as src, open(copy, "wb") as dst:
        dst.write(src.read())
    out = _run(_PROBE, copy)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [copy, "True", "True"]


def test_missing_file_is_a_config_error_naming_the_variable() -> None:
    code = (
        "from agent_infer.native import load_native\n"
        "from agent_infer.errors import ConfigError\n"
        "try:\n    load_native()\nexcept ConfigError as e:\n    print('ConfigError', e)\n"
    )
    out = _run(code, "/nonexistent/_native.so")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ConfigError AGENT_INFER_NATIVE_LIBRARY='/nonexistent/_native.so'")


def test_a_file_that_is_not_an_extension_is_a_typed_error(tmp_path: pytest.TempPathFactory) -> None:
    bogus = os.path.join(str(tmp_path), "_native.cpython-311-x86_64-linux-gnu.so")
    with open(bogus, "wb") as f:
        f.write(b"not an ELF file")
    code = (
        "from agent_infer.native import load_native\n"
        "from agent_infer.errors import AgentInferError\n"
        "try:\n    load_native()\nexcept AgentInferError as e:\n    print(type(e).__name__)\n"
    )
    out = _run(code, bogus)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in (ConfigError.__name__, NativeExtensionMissingError.__name__)
