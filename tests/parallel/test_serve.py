"""``agent-infer serve --data-parallel-size 2 --expert-parallel`` as a real process on loopback,
queried with the real ``openai`` client: greedy chat output equal to one process (a long prompt
prefilled over both ranks too), the parallel metrics on /metrics, and /health turning 503 when a
rank is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agent_infer import LLM, SamplingParams
from agent_infer.parallel.group import free_port

openai = pytest.importorskip("openai")
MESSAGES = [{"role": "user", "content": "Name three rivers."}]


def _rank_pids(server_pid: int) -> list[int]:
    """The server's spawned rank processes (not the multiprocessing resource tracker)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    ranks = []
    for pid in map(int, children):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            ranks.append(pid)
    return sorted(ranks)


@pytest.fixture(scope="module")
def served(model_dir: str) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "agent_infer.cli", "serve", "--model", model_dir, "--port", str(port),
        "--kv-cache-memory-bytes", str(32 * 1024 * 1024), "--data-parallel-size", "2", "--expert-parallel",
        "--redundant-experts", "2", "--eplb-interval", "4", "--cp-prefill-threshold", "128",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stderr.read().decode() if proc.stderr else ''}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the server did not start within 120 s")
        time.sleep(0.5)
    try:
        yield base, proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_chat_equals_one_process_and_metrics_show_ranks(
    served: tuple[str, subprocess.Popen[bytes]], model_dir: str
) -> None:
    base, _ = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    replies = [
        client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=16)
        for _ in range(3)
    ]
    want = LLM(model=model_dir, kv_cache_memory_bytes=32 * 1024 * 1024).chat(
        MESSAGES, SamplingParams(temperature=0.0, max_tokens=16)
    )[0]
    for reply in replies:
        assert reply.choices[0].message.content == want.outputs[0].text
    text = httpx.get(base + "/metrics", timeout=10).text
    assert "agent_infer_parallel_ranks 2" in text
    assert "agent_infer_parallel_healthy 1" in text
    assert 'agent_infer_parallel_rank_generated_tokens_total{rank="0"}' in text


def test_a_long_prompt_is_prefilled_over_the_ranks(
    served: tuple[str, subprocess.Popen[bytes]], model_dir: str
) -> None:
    base, _ = served
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    long = [
        {"role": "user", "content": "Summarize: " + " ".join(f"River {i} flows north." for i in range(40))}
    ]
    reply = client.chat.completions.create(model=model, messages=long, temperature=0, max_tokens=12)
    want = LLM(model=model_dir, kv_cache_memory_bytes=32 * 1024 * 1024).chat(
        long, SamplingParams(temperature=0.0, max_tokens=12)
    )[0]
    assert len(want.prompt_token_ids) > 128
    assert reply.choices[0].message.content == want.outputs[0].text
    deadline = time.monotonic() + 10
    while "agent_infer_parallel_cp_prefills_total 1" not in (text := httpx.get(base + "/metrics").text):
        assert time.monotonic() < deadline, text
        time.sleep(0.3)
    assert 'agent_infer_parallel_cp_prefill_seconds_total{rank="1"}' in text
    assert 'agent_infer_parallel_rank_weight_bytes{rank="0"}' in text


ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "river",
        "schema": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "km": {"type": "integer"}},
            "required": ["name", "km"],
        },
    },
}


def _structured_replies(base_url: str) -> list[tuple[str | None, str | None, str | None]]:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    out = []
    for choice in ("add", None):
        kw: dict = (
            {"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": choice}}}
            if choice
            else {"response_format": SCHEMA}
        )
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Add 2 and 3."}],
            temperature=0,
            max_tokens=40,
            **kw,
        )
        message = reply.choices[0].message
        calls = message.tool_calls or []
        call = calls[0].function if calls else None
        out.append((message.content, call.name if call else None, call.arguments if call else None))
    return out


def test_tool_calls_and_schemas_equal_a_one_process_server(
    served: tuple[str, subprocess.Popen[bytes]], model_dir: str
) -> None:
    from server_harness import running_server

    from agent_infer.model.loader import load_model

    got = _structured_replies(served[0])
    with running_server(load_model(model_dir), kv_cache_memory_bytes=32 * 1024 * 1024) as live:
        want = _structured_replies(live.base_url)
    assert got == want
    assert got[0][1] == "add" and got[0][2]  # a random model's arguments may be cut by max_tokens
    assert got[1][0]


def test_a_killed_rank_makes_the_server_unhealthy(served: tuple[str, subprocess.Popen[bytes]]) -> None:
    base, proc = served
    ranks = _rank_pids(proc.pid)
    assert len(ranks) == 2
    os.kill(ranks[1], signal.SIGKILL)
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    deadline = time.monotonic() + 60
    status = 200
    while status == 200 and time.monotonic() < deadline:
        time.sleep(0.2)
        status = httpx.get(base + "/health", timeout=10).status_code
    assert status == 503
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4)
    assert err.value.status_code >= 500
    assert "rank" in str(err.value.body)
    assert "agent_infer_parallel_healthy 0" in httpx.get(base + "/metrics", timeout=10).text
