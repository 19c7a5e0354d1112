"""OpenAI-compatible server benchmark: agent-infer vs llama-cpp-python's server on the same GGUF.

Each server runs as its own process, one after the other (never both at once), on the same model
file. Clients stream chat completions constrained by one JSON Schema (``response_format``: OpenAI's
``json_schema`` for agent-infer, ``json_object`` + ``schema`` for llama-cpp-python, which is how
that server takes a schema). At each concurrency level C, C clients each send requests back to
back until the level's request count is reached. Per request: TTFT (send -> first content chunk),
inter-token latency (gaps between content chunks), end-to-end latency (send -> ``[DONE]``). Output
tokens are counted by re-tokenizing each reply with the model's own tokenizer, so both servers are
counted the same way. Throughput = output tokens of the level / the level's wall time.

    .venv/bin/python benchmarks/bench_server.py --quick      # a few minutes on 2 cores
    .venv/bin/python benchmarks/bench_server.py              # more requests per level

Raw results: ``bench_results/server-<timestamp>.json``; the markdown table goes to stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 16},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@dataclass
class Sample:
    """One request's timings (seconds) and output size."""

    ttft: float
    e2e: float
    gaps: list[float]
    tokens: int
    valid_json: bool
    status: int


@dataclass
class Level:
    """All requests of one server at one concurrency level."""

    server: str
    clients: int
    wall_s: float
    samples: list[Sample] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _start(server: str, model: Path, port: int, threads: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    if server == "agent-infer":
        env["AGENT_INFER_NUM_THREADS"] = str(threads)
        cmd = [
            sys.executable,
            "-m",
            "agent_infer.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            str(port),
            "--served-model-name",
            "model",
            "--max-num-seqs",
            "64",
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "llama_cpp.server",
            "--model",
            str(model),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
            "--model_alias",
            "model",
            "--n_ctx",
            "4096",
            "--n_threads",
            str(threads),
            "--n_threads_batch",
            str(threads),
            "--interrupt_requests",
            "False",
            "--verbose",
            "False",
        ]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_ready(base: str, proc: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not become ready")


def _body(server: str, i: int, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "model",
        "messages": [{"role": "user", "content": f"Invent person number {i}: JSON with name, age and city."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    if server == "agent-infer":
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": SCHEMA, "strict": True},
        }
    else:
        body["response_format"] = {"type": "json_object", "schema": SCHEMA}
    return body


async def _request(http: httpx.AsyncClient, base: str, body: dict[str, Any], count: Any) -> Sample:
    start = time.perf_counter()
    stamps: list[float] = []
    text = ""
    async with http.stream("POST", base + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return Sample(0.0, time.perf_counter() - start, [], 0, False, resp.status_code)
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            if not payload.get("choices"):
                continue
            delta = payload["choices"][0].get("delta", {}).get("content") or ""
            if delta:
                stamps.append(time.perf_counter())
                text += delta
    end = time.perf_counter()
    try:
        json.loads(text)
        valid = True
    except ValueError:
        valid = False
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    ttft = (stamps[0] - start) if stamps else end - start
    return Sample(ttft, end - start, gaps, count(text), valid, 200)


async def _level(server: str, base: str, clients: int, total: int, max_tokens: int, count: Any) -> Level:
    next_index = iter(range(total))
    level = Level(server, clients, 0.0)

    async def client(http: httpx.AsyncClient) -> None:
        for i in next_index:
            level.samples.append(await _request(http, base, _body(server, i, max_tokens), count))

    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=clients + 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        level.wall_s = time.perf_counter() - start
    return level


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(level: Level) -> dict[str, Any]:
    """Throughput and p50/p90/p99 latencies (ms) of one level."""
    ok = [s for s in level.samples if s.status == 200]
    gaps = [g for s in ok for g in s.gaps]
    tokens = sum(s.tokens for s in ok)
    out: dict[str, Any] = {
        "server": level.server,
        "clients": level.clients,
        "requests": len(level.samples),
        "errors": len(level.samples) - len(ok),
        "valid_json": sum(s.valid_json for s in ok),
        "tokens": tokens,
        "wall_s": level.wall_s,
        "tok_per_s": tokens / level.wall_s if level.wall_s else 0.0,
        "mean_tokens": statistics.mean(s.tokens for s in ok) if ok else 0.0,
    }
    for name, values in (("ttft", [s.ttft for s in ok]), ("itl", gaps), ("e2e", [s.e2e for s in ok])):
        for q in (0.5, 0.9, 0.99):
            out[f"{name}_p{round(q * 100)}_ms"] = _pct(values, q) * 1000
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of all levels, plus ours/peer ratios per level."""
    head = (
        "| server | clients | requests | valid JSON | tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms "
        "| E2E p50/p90/p99 ms |\n|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['server']} | {r['clients']} | {r['requests']} | {r['valid_json']}/{r['requests'] - r['errors']} "
            f"| {r['tok_per_s']:.1f} "
            f"| {r['ttft_p50_ms']:.0f} / {r['ttft_p90_ms']:.0f} / {r['ttft_p99_ms']:.0f} "
            f"| {r['itl_p50_ms']:.1f} / {r['itl_p90_ms']:.1f} / {r['itl_p99_ms']:.1f} "
            f"| {r['e2e_p50_ms']:.0f} / {r['e2e_p90_ms']:.0f} / {r['e2e_p99_ms']:.0f} |"
        )
    by = {(r["server"], r["clients"]): r for r in rows}
    ratios = []
    for (server, clients), ours in sorted(by.items(), key=lambda kv: kv[0][1]):
        peer = by.get(("llama-cpp-python", clients))
        if server != "agent-infer" or peer is None or not peer["tok_per_s"]:
            continue
        ratios.append(
            f"| {clients} | {ours['tok_per_s'] / peer['tok_per_s']:.2f}x "
            f"| {ours['e2e_p50_ms'] / peer['e2e_p50_ms']:.2f} | {ours['ttft_p50_ms'] / peer['ttft_p50_ms']:.2f} |"
        )
    if ratios:
        lines += [
            "",
            "| clients | throughput ours/peer | p50 E2E ours/peer | p50 TTFT ours/peer |",
            "|---|---|---|---|",
            *ratios,
        ]
    return "\n".join(lines)


def run_server(
    server: str,
    model: Path,
    levels: list[int],
    per_client: int,
    minimum: int,
    max_tokens: int,
    threads: int,
    count: Any,
) -> list[Level]:
    """Start ``server``, warm it up, run every level, stop it."""
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = _start(server, model, port, threads)
    try:
        _wait_ready(base, proc)
        asyncio.run(
            _level(server, base, 1, 2, max_tokens, count)
        )  # warm-up: grammar caches, first allocations
        results = []
        for clients in levels:
            total = max(clients * per_client, minimum)
            print(f"{server}: {clients} clients, {total} requests", file=sys.stderr)
            results.append(asyncio.run(_level(server, base, clients, total, max_tokens, count)))
        return results
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; prints the table, writes the JSON."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="one request per client (at least 4 per level)")
    parser.add_argument("--levels", default="1,8,32", help="concurrency levels (comma-separated)")
    parser.add_argument("--per-client", type=int, default=3, help="requests per client at each level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="compute threads per server")
    parser.add_argument("--servers", default="agent-infer,llama-cpp-python")
    parser.add_argument("--model", type=Path, default=None, help="GGUF file (default: SmolLM2-135M-Instruct)")
    args = parser.parse_args(argv)

    from agent_infer.model.loader import default_model_path, load_model

    model = args.model or default_model_path()
    tokenizer = load_model(str(model)).tokenizer

    def count(text: str) -> int:
        return len(tokenizer.encode(text)) if text else 0

    levels = [int(x) for x in args.levels.split(",")]
    per_client, minimum = (1, 4) if args.quick else (args.per_client, 8)
    rows: list[dict[str, Any]] = []
    raw: list[dict[str, Any]] = []
    for server in args.servers.split(","):
        for level in run_server(
            server, model, levels, per_client, minimum, args.max_tokens, args.threads, count
        ):
            rows.append(summarize(level))
            raw.append({**asdict(level)})
    print(table(rows))
    out_dir = ROOT / "bench_results"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / f"server-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "model": str(model),
                "summary": rows,
                "raw": raw,
            },
            indent=1,
        )
    )
    print(f"raw results: {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
