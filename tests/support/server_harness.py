"""A live agent-infer server on a free loopback port, run by uvicorn in a thread (used by test_server_*)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import uvicorn

from agent_infer.engine.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.server import ServerConfig, create_app

TEST_KV_BYTES = 64 * 1024 * 1024


@dataclass
class LiveServer:
    """Where the server listens and the engine behind it."""

    base_url: str
    engine: LLMEngine
    model: str

    @property
    def v1(self) -> str:
        """The OpenAI base URL."""
        return self.base_url + "/v1"


@contextmanager
def running_server(
    loaded: Any, config: ServerConfig | None = None, **engine_options: Any
) -> Iterator[LiveServer]:
    """Serve the already-loaded model until the block exits."""
    engine_options.setdefault("kv_cache_memory_bytes", TEST_KV_BYTES)
    engine = LLMEngine(config=EngineConfig(**engine_options), loaded=loaded)
    app = create_app(engine, config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", engine, app.state.server.model_name)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def server_fixture(config: ServerConfig | None = None, **engine_options: Any) -> Any:
    """A module-scoped ``server`` fixture serving the session's model (``server = server_fixture()``)."""

    @pytest.fixture(scope="module")
    def server(loaded_model: Any) -> Iterator[LiveServer]:
        with running_server(loaded_model, config, **engine_options) as live:
            yield live

    return server


def openai_client(live: LiveServer) -> Any:
    """The official ``openai`` client on ``live``, without retries so that every error shows."""
    import openai

    return openai.OpenAI(base_url=live.v1, api_key="unused", max_retries=0, timeout=120)
