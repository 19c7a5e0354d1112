"""Shared fixtures: the default model is loaded once per session and shared by every engine."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# Shared test helpers (server harness, fuzz worker, conformance ratchets, grammar cases) live in
# tests/support/ and are imported by plain module name from every test folder.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

# torch's OpenMP threads busy-wait by default, which starves everything else on a small machine.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# A server freezes its start-up heap (agent_infer/gc_heap.py). That is permanent for the process:
# in one test process that starts dozens of servers it would pin whatever earlier tests left
# alive. tests/test_gc_heap.py turns it on where it is the subject.
os.environ.setdefault("AGENT_INFER_GC_FREEZE", "0")

# Small enough for a shared CI box, large enough that tests never hit the pool limit by accident.
TEST_KV_BYTES = 64 * 1024 * 1024


@pytest.fixture(scope="session")
def loaded_model() -> Any:
    """The default model (SmolLM2-135M-Instruct), loaded once."""
    from agent_infer.model.loader import load_model

    return load_model()


@pytest.fixture(scope="session")
def make_llm(loaded_model: Any) -> Callable[..., Any]:
    """Build an ``LLM`` with the given EngineConfig options on the shared weights."""
    from agent_infer.engine.config import EngineConfig
    from agent_infer.engine.llm_engine import LLMEngine
    from agent_infer.llm import LLM

    def build(**config: Any) -> LLM:
        config.setdefault("kv_cache_memory_bytes", TEST_KV_BYTES)
        return LLM.from_engine(LLMEngine(config=EngineConfig.from_kwargs(**config), loaded=loaded_model))

    return build


@pytest.fixture(scope="session")
def llm(make_llm: Callable[..., Any]) -> Any:
    """One default-configured ``LLM`` shared by the whole session."""
    return make_llm()
