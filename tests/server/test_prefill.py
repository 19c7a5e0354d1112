"""Long prompts do not stall other streams: chunked prefill under a small budget while others decode,
prompts tokenized off the engine thread, and prompts too large for the context rejected before that."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from typing import Any

import httpx
import pytest
from server_harness import LiveServer, server_fixture

from agent_infer.server import ServerConfig

STREAMS = 16
server = server_fixture(
    ServerConfig(max_body_bytes=4 * 1024 * 1024), kv_cache_memory_bytes=256 * 1024 * 1024, max_num_seqs=32
)


async def _stream(
    http: httpx.AsyncClient, server: LiveServer, i: int, started: asyncio.Event, max_tokens: int
) -> list[float]:
    """Arrival times of one stream's content chunks."""
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": f"Tell me a long story about dragon number {i}."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    times: list[float] = []
    async with http.stream("POST", server.v1 + "/chat/completions", json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice["delta"].get("content"):
                times.append(time.perf_counter())
                if len(times) == 3:
                    started.set()
    return times


async def _gaps(
    server: LiveServer, intruder: dict[str, Any] | None, max_tokens: int = 40
) -> tuple[list[float], Any]:
    """Inter-chunk gaps of STREAMS concurrent streams; ``intruder`` is posted once they are flowing."""
    async with httpx.AsyncClient(timeout=300) as http:
        started = asyncio.Event()
        streams = [asyncio.create_task(_stream(http, server, i, started, max_tokens)) for i in range(STREAMS)]
        other = None
        if intruder is not None:
            await started.wait()
            other = asyncio.create_task(http.post(server.v1 + "/chat/completions", json=intruder))
        results = await asyncio.gather(*streams)
        answer = None
        if other is not None:
            if other.done():
                answer = other.result()
            else:
                other.cancel()  # the client hangs up: the server aborts the long request
    gaps = sorted(b - a for times in results for a, b in itertools.pairwise(times[2:]))
    return gaps, answer


def _p95(gaps: list[float]) -> float:
    return gaps[int(0.95 * (len(gaps) - 1))]


def test_absurd_prompt_is_rejected_without_stalling_streams(server: LiveServer) -> None:
    # ~2 MB of text: far more tokens than the context could ever hold.
    huge = "The quick brown fox jumps over the lazy dog. " * 45000
    intruder = {"model": server.model, "messages": [{"role": "user", "content": huge}], "max_tokens": 4}
    gaps, answer = asyncio.run(_gaps(server, intruder))
    assert answer is not None and answer.status_code == 400, answer
    error = answer.json()["error"]
    assert error["param"] == "messages" and "exceeds the context" in error["message"]
    # Tokenizing it on the engine thread would have held every stream for seconds.
    assert gaps[-1] < 1.0, gaps[-5:]


@pytest.mark.slow
def test_long_prompt_keeps_streams_flowing(server: LiveServer) -> None:
    # The streams run long enough to overlap the whole prefill (~190 steps), the deep chunks included.
    baseline, _ = asyncio.run(_gaps(server, None, 240))
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 300  # ~3,000 tokens
    intruder = {
        "model": server.model,
        "messages": [{"role": "user", "content": long_prompt}],
        "max_tokens": 4,
    }
    loaded, _ = asyncio.run(_gaps(server, intruder, 240))
    print(
        f"p95 gap alone {_p95(baseline):.3f}s, with the long prompt {_p95(loaded):.3f}s; max {loaded[-1]:.3f}s"
    )
    assert _p95(loaded) < 5 * _p95(baseline), (baseline[-5:], loaded[-5:])
