"""Interpreter exit while a daemon engine thread is mid-step: the process ends cleanly; and a
client call made after exit began is refused with the typed error.

A daemon thread still inside a native call at finalization is cut off by CPython with
``pthread_exit``, and the unwind through a C++ ``noexcept`` frame aborts the process
(``terminate called without an active exception``, exit code 134). Each script leaves a request
running on the default model and exits without closing anything.

When the main thread ends, ``concurrent.futures`` makes every thread pool refuse new work before
the interpreter joins the threads still running. A non-daemon thread with a call in flight then
gets its answer, and its next call is refused with ``ClientClosedError``, never the pools'
"cannot schedule new futures after shutdown".
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from concurrent.futures import thread as futures_thread

import pytest

CLIENT = """
    import threading, time
    import torch
    from pydantic import BaseModel
    from agent_infer import Client
    from agent_infer.errors import EngineError

    torch.set_num_threads(1)

    class Story(BaseModel):
        title: str
        body: str

    client = Client()
    stream = iter(client.generate_stream("Write a long story.", schema=Story, max_tokens=400))
    next(stream)  # the stepping thread is busy with the request from here on

    def read() -> None:
        try:
            for _ in stream:
                pass
        except EngineError as exc:
            print("reader:", exc, flush=True)

    threading.Thread(target=read, daemon=True).start()
    time.sleep(0.2)
    print("exiting", flush=True)
"""

SERVER_ENGINE = """
    import asyncio
    import torch
    from agent_infer.engine.config import EngineConfig
    from agent_infer.engine.llm_engine import LLMEngine
    from agent_infer.model.loader import load_model
    from agent_infer.sampling_params import SamplingParams
    from agent_infer.server.async_engine import AsyncEngine
    from agent_infer.server.metrics import ServerMetrics

    torch.set_num_threads(1)
    engine = LLMEngine(config=EngineConfig.from_kwargs(kv_cache_memory_bytes=64 << 20), loaded=load_model())

    async def main() -> None:
        running = AsyncEngine(engine, ServerMetrics())
        running.start()
        await running.add("r", "Write a long story.", SamplingParams(max_tokens=400, ignore_eos=True))
        await asyncio.sleep(0.2)

    asyncio.run(main())  # the loop closes; the engine thread keeps stepping "r"
    print("exiting", flush=True)
"""


# A non-daemon thread (the interpreter waits for it) streams a constrained call that is in flight
# when the main thread ends, reads it to the end, then makes one more call.
NON_DAEMON_CLIENT = """
    import threading
    import torch
    from pydantic import BaseModel
    from agent_infer import Client

    torch.set_num_threads(1)

    class City(BaseModel):
        name: str
        country: str

    client = Client()
    in_flight = threading.Event()

    def work() -> None:
        stream = client.generate_stream("Name a city.", schema=City, max_tokens=30)
        next(stream)
        in_flight.set()
        chunks = 1 + sum(1 for _ in stream)
        print("in flight: finished,", chunks, "chunks", flush=True)
        try:
            client.generate("Name another city.", schema=City, max_tokens=30)
            print("next call: answered", flush=True)
        except Exception as exc:
            print("next call:", type(exc).__name__, exc, flush=True)

    threading.Thread(target=work).start()
    in_flight.wait()
    print("exiting", flush=True)
"""

NON_DAEMON_ASYNC_CLIENT = """
    import asyncio, threading
    import torch
    from pydantic import BaseModel
    from agent_infer import AsyncClient

    torch.set_num_threads(1)

    class City(BaseModel):
        name: str
        country: str

    client = AsyncClient()
    in_flight = threading.Event()

    async def work() -> None:
        stream = client.generate_stream("Name a city.", schema=City, max_tokens=30)
        await stream.__anext__()
        in_flight.set()
        chunks = 1
        async for _ in stream:
            chunks += 1
        print("in flight: finished,", chunks, "chunks", flush=True)
        try:
            await client.generate("Name another city.", schema=City, max_tokens=30)
            print("next call: answered", flush=True)
        except Exception as exc:
            print("next call:", type(exc).__name__, exc, flush=True)

    threading.Thread(target=asyncio.run, args=(work(),)).start()
    in_flight.wait()
    print("exiting", flush=True)
"""


def _run(script: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("script", [NON_DAEMON_CLIENT, NON_DAEMON_ASYNC_CLIENT], ids=["sync", "async"])
def test_a_call_after_exit_began_is_refused_with_the_typed_error(script: str) -> None:
    done = _run(script)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "cannot schedule new futures" not in done.stdout + done.stderr, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert "exiting" in lines
    assert any(line.startswith("in flight: finished,") for line in lines), done.stdout
    assert (
        "next call: ClientClosedError the interpreter is exiting: the local client takes no new requests"
        in lines
    ), done.stdout + done.stderr[-2000:]


def test_parallel_tools_run_on_the_caller_once_pools_refuse_work(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent_infer import Client, tool
    from agent_infer.client.agent import PendingCall, ToolBatch

    seen: list[str] = []

    @tool
    def record(text: str) -> str:
        """Record a text."""
        seen.append(text)
        return text.upper()

    calls = [PendingCall(str(i), "record", f'{{"text": "t{i}"}}', record) for i in range(3)]
    # What concurrent.futures sets as the interpreter begins to exit: every pool refuses new work.
    monkeypatch.setattr(futures_thread, "_shutdown", True)
    outcomes = Client._run_tools(ToolBatch(calls, parallel=True))
    assert outcomes == [("ok", "T0"), ("ok", "T1"), ("ok", "T2")]
    assert seen == ["t0", "t1", "t2"]  # each exactly once, in order, on this thread


@pytest.mark.parametrize("script", [CLIENT, SERVER_ENGINE], ids=["client", "server-engine"])
def test_exit_with_a_request_in_flight_is_clean(script: str) -> None:
    done = _run(script)
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exiting" in done.stdout
    # What the reader thread is told is not asserted here: it is a daemon thread, so whether it
    # prints before finalization is a race. Closing a client with a call in flight (the caller gets
    # EngineError) is tested in tests/client/test_generate.py.
