"""freeze_startup_heap: collects first, then freezes; AGENT_INFER_GC_FREEZE parses as a flag."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from agent_infer import envs
from agent_infer.errors import ConfigError
from agent_infer.gc_heap import freeze_startup_heap


@pytest.fixture
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()  # later tests get a collector that sees everything again


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_garbage_is_collected_before_the_freeze(unfrozen: None) -> None:
    freed: list[bool] = []
    garbage = _Node()
    weakref.finalize(garbage, freed.append, True)
    alive = _Node()
    del garbage
    count = freeze_startup_heap()
    assert freed == [True]
    # Frozen objects can still be freed by reference counting (other threads of the test process
    # drop theirs at any time), so the count can only shrink after the freeze.
    assert 0 < gc.get_freeze_count() <= count
    # Frozen objects sit outside every generation, so the live cycle is no longer tracked there.
    assert all(alive is not o for o in gc.get_objects())


def test_objects_made_after_the_freeze_are_still_collected(unfrozen: None) -> None:
    freeze_startup_heap()
    freed: list[bool] = []
    later = _Node()
    weakref.finalize(later, freed.append, True)
    del later
    gc.collect()
    assert freed == [True]


def test_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENT_INFER_GC_FREEZE", raising=False)
    assert envs.gc_freeze() is True
    monkeypatch.setenv("AGENT_INFER_GC_FREEZE", "0")
    assert envs.gc_freeze() is False
    monkeypatch.setenv("AGENT_INFER_GC_FREEZE", "maybe")
    with pytest.raises(ConfigError, match="AGENT_INFER_GC_FREEZE"):
        envs.gc_freeze()


@pytest.mark.parametrize("setting, frozen", [(None, True), ("0", False)])
def test_server_start_freezes_unless_told_not_to(
    loaded_model: object, monkeypatch: pytest.MonkeyPatch, unfrozen: None, setting: str | None, frozen: bool
) -> None:
    import asyncio

    from agent_infer.engine.config import EngineConfig
    from agent_infer.engine.llm_engine import LLMEngine
    from agent_infer.server import create_app

    if setting is None:
        monkeypatch.delenv("AGENT_INFER_GC_FREEZE", raising=False)
    else:
        monkeypatch.setenv("AGENT_INFER_GC_FREEZE", setting)
    engine = LLMEngine(config=EngineConfig(kv_cache_memory_bytes=16 << 20), loaded=loaded_model)
    app = create_app(engine)

    async def start_and_stop() -> int:
        async with app.router.lifespan_context(app):
            return gc.get_freeze_count()

    assert (asyncio.run(start_and_stop()) > 0) is frozen
