"""sglang-router in front of two real ``agent-infer serve`` replicas on loopback.

The replicas are shared by the module; the failure test kills one of them, so it runs last.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("sglang_router")

from agent_infer.cluster.processes import (
    LocalCluster,
    Process,
    scrape,
    wait_healthy,
    wait_router_ready,
)

MODEL = "SmolLM2-135M-Instruct.Q4_1"
REPLICA_ARGS = ["--kv-cache-memory-bytes", str(32 << 20), "--max-num-seqs", "8", "--speculative-tokens", "0"]
AGENTS = 4
TURNS = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, list[Process]]]:
    with LocalCluster(Path(tmp_path_factory.mktemp("cluster"))) as local:
        replicas = [local.replica(args=REPLICA_ARGS) for _ in range(2)]
        for replica in replicas:
            wait_healthy(replica)
        yield local, replicas


def _system_prompt(agent: int, tag: str) -> str:
    # Long and distinct per agent: what an agent resends every turn (instructions + tool schemas).
    rules = " ".join(
        f"Rule {i}: answer agent {agent} of run {tag} with care about topic {i * 7 + agent}."
        for i in range(24)
    )
    return f"You are agent {agent} ({tag}). {rules}"


def _run_agents(router: str, tag: str) -> None:
    """Each agent runs its turns in order, resending its whole transcript every turn."""
    for agent in range(AGENTS):
        messages: list[dict[str, str]] = [{"role": "system", "content": _system_prompt(agent, tag)}]
        for turn in range(TURNS):
            messages.append({"role": "user", "content": f"Step {turn}: reply with one short sentence."})
            body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0}
            resp = httpx.post(router + "/v1/chat/completions", json=body, timeout=120)
            assert resp.status_code == 200, resp.text
            messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})


def _totals(replicas: list[Process]) -> tuple[float, float]:
    prompt = cached = 0.0
    for replica in replicas:
        metrics = scrape(replica.url)
        prompt += metrics["agent_infer_prompt_tokens_total"]
        cached += metrics["agent_infer_prompt_tokens_cached_total"]
    return prompt, cached


def _hit_rate(local: LocalCluster, replicas: list[Process], policy: str) -> float:
    router = local.router([r.url for r in replicas], policy=policy)
    try:
        wait_router_ready(router, len(replicas))
        flushed = httpx.post(router.url + "/flush_cache", timeout=30)
        assert flushed.status_code == 200, flushed.text
        prompt0, cached0 = _totals(replicas)
        _run_agents(router.url, policy)
        prompt1, cached1 = _totals(replicas)
    finally:
        router.stop()
    return (cached1 - cached0) / (prompt1 - prompt0)


def test_cache_aware_routing_hits_the_prefix_cache_more_than_round_robin(
    cluster: tuple[LocalCluster, list[Process]],
) -> None:
    local, replicas = cluster
    round_robin = _hit_rate(local, replicas, "round_robin")
    cache_aware = _hit_rate(local, replicas, "cache_aware")
    # Round robin sends an agent's consecutive turns to alternating replicas, so each agent pays its
    # system prompt on both; cache-aware keeps an agent on the replica that holds its prefix.
    assert cache_aware > round_robin + 0.1, (round_robin, cache_aware)


def test_killing_a_replica_mid_run_loses_no_request_and_hangs_no_stream(
    cluster: tuple[LocalCluster, list[Process]],
) -> None:
    local, replicas = cluster
    router = local.router([r.url for r in replicas], policy="round_robin")
    wait_router_ready(router, len(replicas))
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Tell a long story about a lighthouse."}],
        "max_tokens": 48,
        "ignore_eos": True,
        "temperature": 0,
    }
    results: dict[str, Any] = {}

    def plain(i: int) -> None:
        resp = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=90)
        results[f"plain{i}"] = (resp.status_code, resp.json())

    def stream(i: int) -> None:
        lines: list[str] = []
        start = time.monotonic()
        try:
            with httpx.stream(
                "POST", router.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=90
            ) as resp:
                lines.extend(line for line in resp.iter_lines() if line)
            results[f"stream{i}"] = ("closed", lines, time.monotonic() - start)
        except httpx.TransportError as exc:
            results[f"stream{i}"] = (type(exc).__name__, lines, time.monotonic() - start)

    threads = [threading.Thread(target=plain, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    deadline = time.monotonic() + 30
    while sum(httpx.get(r.url + "/get_load").json()[0]["num_reqs"] for r in replicas) < 8:
        assert time.monotonic() < deadline, "the requests never all reached the replicas"
        time.sleep(0.05)
    replicas[1].kill()
    for thread in threads:
        thread.join(120)
    assert not any(t.is_alive() for t in threads), "a request hung after the replica died"

    for i in range(4):
        status, payload = results[f"plain{i}"]
        assert status == 200, payload
        assert payload["usage"]["completion_tokens"] == 48  # retried on the live replica, whole
    ended = [results[f"stream{i}"] for i in range(4)]
    finished = [lines for how, lines, _ in ended if how == "closed" and lines[-1] == "data: [DONE]"]
    cut = [
        (how, lines)
        for how, lines, _ in ended
        if not (how == "closed" and lines and lines[-1] == "data: [DONE]")
    ]
    # sglang-router 0.3.2 forwards the worker's stream as it comes: when the worker dies it ends the
    # chunked response early, which clients see as an incomplete body (a transport error), never a
    # stream that looks complete.
    assert cut, "no stream was on the killed replica"
    for how, lines in cut:
        assert how != "closed" or (lines and lines[-1].startswith("data: {") and '"error"' in lines[-1]), how
        assert "data: [DONE]" not in lines
    for lines in finished:
        assert '"finish_reason":"length"' in lines[-2]
    assert max(seconds for _, _, seconds in ended) < 60
    router.stop()
