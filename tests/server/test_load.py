"""Load: 32 concurrent streaming clients, some hanging up midway; afterwards the KV pool is fully free."""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import httpx
import pytest
from server_harness import LiveServer, server_fixture

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
CLIENTS = 32
DISCONNECT_EVERY = 6  # clients 0, 6, 12, ... hang up after a few chunks


server = server_fixture(max_num_seqs=CLIENTS)


def _metrics(server: LiveServer) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(agent_infer_\S+) (\S+)$", text, re.M)}


def _wait_until_idle(server: LiveServer) -> dict[str, float]:
    # Aborts are applied by the engine thread between steps: poll briefly instead of racing it.
    deadline = time.monotonic() + 30
    while True:
        m = _metrics(server)
        idle = (
            m["agent_infer_kv_blocks_free"] == m["agent_infer_kv_blocks_total"]
            and m["agent_infer_requests_running"] == 0
            and m["agent_infer_requests_waiting"] == 0
            and m["agent_infer_active_streams"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


async def _one(http: httpx.AsyncClient, server: LiveServer, i: int) -> dict[str, Any]:
    body = {
        "model": server.model,
        "messages": [
            {"role": "user", "content": f"Invent person number {i} as JSON with a name and an age."}
        ],
        "max_tokens": 40,
        "temperature": 0.8,
        "seed": i,
        "stream": True,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
        },
    }
    hang_up = i % DISCONNECT_EVERY == 0
    text, finish, chunks = "", None, 0
    async with http.stream("POST", server.v1 + "/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            return {"status": resp.status_code, "body": (await resp.aread()).decode()}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            assert "error" not in payload, payload
            choice = payload["choices"][0]
            text += choice["delta"].get("content") or ""
            finish = choice["finish_reason"] or finish
            chunks += 1
            if hang_up and chunks == 3:
                break  # leaving the block closes the connection mid-stream
    return {"status": 200, "text": text, "finish": finish, "hung_up": hang_up}


async def _run_all(server: LiveServer) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=CLIENTS + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        return await asyncio.gather(*(_one(http, server, i) for i in range(CLIENTS)))


def test_concurrent_streams_with_disconnects_free_every_block(server: LiveServer) -> None:
    before = _metrics(server)
    results = asyncio.run(_run_all(server))
    assert [r for r in results if r["status"] != 200] == []
    completed = [r for r in results if not r["hung_up"]]
    assert len(completed) == CLIENTS - len(range(0, CLIENTS, DISCONNECT_EVERY))
    for r in completed:
        assert r["finish"] in ("stop", "length"), r
        if r["finish"] == "stop":
            jsonschema.validate(json.loads(r["text"]), SCHEMA)
    assert sum(r["finish"] == "stop" for r in completed) >= len(completed) // 2
    after = _wait_until_idle(server)
    assert after["agent_infer_kv_blocks_free"] == after["agent_infer_kv_blocks_total"]
    aborted = after.get('agent_infer_requests_finished_total{finish_reason="abort"}', 0) - before.get(
        'agent_infer_requests_finished_total{finish_reason="abort"}', 0
    )
    # Each hang-up comes after 3 chunks, long before its object can be complete: every one is aborted.
    assert aborted == CLIENTS - len(completed)
    assert not any(k.startswith("agent_infer_http_requests_total") and 'status="5' in k for k in after)


def test_non_streaming_client_timeout_aborts_the_request(server: LiveServer) -> None:
    before = _metrics(server)
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Write a long story."}],
        "max_tokens": 2000,
        "temperature": 0,
        "stream": False,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.v1 + "/chat/completions", json=body, timeout=httpx.Timeout(30, read=1.5))
    after = _wait_until_idle(server)
    assert after["agent_infer_kv_blocks_free"] == after["agent_infer_kv_blocks_total"]
    key = 'agent_infer_requests_finished_total{finish_reason="abort"}'
    assert after.get(key, 0) == before.get(key, 0) + 1
