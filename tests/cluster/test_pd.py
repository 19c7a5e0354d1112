"""Prefill/decode disaggregation behind sglang-router's PD mode, KV moved by Mooncake over TCP."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("sglang_router")
pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine-non-cuda and libibverbs1")

from agent_infer.cluster.processes import (
    LocalCluster,
    Process,
    scrape,
    wait_healthy,
    wait_router_ready,
)

MODEL = "SmolLM2-135M-Instruct.Q4_1"
ARGS = ["--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "8", "--speculative-tokens", "0"]
PROMPTS = [
    "Name three colors.",
    "Write one sentence about the sea, then one about mountains.",
    "List the first five prime numbers and say why 1 is not prime.",
    # Long enough (~700 tokens, ~32 MB of KV) that the read spans several Mooncake batches.
    "Summarize these rules in one line. "
    + " ".join(f"Rule {i}: file report {i * 17} before noon on day {i % 7}." for i in range(50)),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Process, Process, Process]]:
    with LocalCluster(Path(tmp_path_factory.mktemp("pd"))) as local:
        prefill = local.replica(args=[*ARGS, "--disaggregation-mode", "prefill"])
        decode = local.replica(args=[*ARGS, "--disaggregation-mode", "decode"])
        wait_healthy(prefill)
        wait_healthy(decode)
        router = local.pd_router([prefill.url], [decode.url])
        wait_router_ready(router, 2)
        yield prefill, decode, router


def _chat(url: str, content: str, **extra: Any) -> dict[str, Any]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 24,
        "temperature": 0,
    }
    resp = httpx.post(url + "/v1/chat/completions", json={**body, **extra}, timeout=180)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def test_disaggregated_greedy_output_equals_colocated_and_decode_never_prefills(
    pair: tuple[Process, Process, Process],
) -> None:
    prefill, decode, router = pair
    per_token = httpx.get(decode.url + "/server_info", timeout=10).json()["kv_bytes_per_token"]
    before = scrape(decode.url)
    expected_bytes = 0
    disaggregated = []
    for prompt in PROMPTS:
        answer = _chat(router.url, prompt)
        disaggregated.append(answer["choices"][0]["message"]["content"])
        usage = answer["usage"]
        # Whole blocks of the prompt move, less those the decode worker's prefix cache held.
        blocks = -(-usage["prompt_tokens"] // 16) - usage["prompt_tokens_details"]["cached_tokens"] // 16
        expected_bytes += blocks * 16 * per_token
    after = scrape(decode.url)
    assert (
        after["agent_infer_prompt_tokens_computed_total"]
        == before["agent_infer_prompt_tokens_computed_total"]
        == 0
    )
    assert after["agent_infer_pd_requests_received_total"] - before[
        "agent_infer_pd_requests_received_total"
    ] == len(PROMPTS)
    moved = after["agent_infer_pd_kv_bytes_received_total"] - before["agent_infer_pd_kv_bytes_received_total"]
    assert moved == expected_bytes
    # The prefill worker serves whole requests too when no bootstrap fields come with them.
    colocated = [_chat(prefill.url, prompt)["choices"][0]["message"]["content"] for prompt in PROMPTS]
    assert disaggregated == colocated


def test_disaggregated_stream_matches_and_ends(pair: tuple[Process, Process, Process]) -> None:
    prefill, _, router = pair
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[1]}],
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
    }
    pieces: list[str] = []
    with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=180) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        for choice in json.loads(line[6:]).get("choices", []):
            pieces.append(choice.get("delta", {}).get("content") or "")
    assert "".join(pieces) == _chat(prefill.url, PROMPTS[1])["choices"][0]["message"]["content"]


def test_a_refused_prefill_fails_the_request_at_once(pair: tuple[Process, Process, Process]) -> None:
    _, _, router = pair
    too_long = " ".join(f"item {i}" for i in range(1500))  # more tokens than either KV pool holds
    started = time.monotonic()
    resp = httpx.post(
        router.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": too_long}], "max_tokens": 4},
        timeout=120,
    )
    assert resp.status_code == 400, resp.text
    # sglang-router re-wraps a decode worker's 400 (code "decode_bad_request"); the prefill
    # worker's reason travels in the message.
    assert "KV cache holds only" in resp.text, resp.text
    assert time.monotonic() - started < 30  # not the decode worker's 60 s wait for the room


def test_bootstrap_fields_on_a_colocated_server_are_a_400(pair: tuple[Process, Process, Process]) -> None:
    prefill, _, _ = pair
    resp = httpx.post(
        prefill.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "bootstrap_room": 5},
        timeout=30,
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "bootstrap_host"


def test_constrained_requests_are_refused_across_the_pair(pair: tuple[Process, Process, Process]) -> None:
    _, decode, _ = pair
    resp = httpx.post(
        decode.url + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_object"},
            "bootstrap_host": "127.0.0.1",
            "bootstrap_port": 1,
            "bootstrap_room": 7,
        },
        timeout=30,
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "not_served_disaggregated"
