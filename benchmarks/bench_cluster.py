"""Serving beyond one replica: one replica vs two behind sglang-router (round_robin, cache_aware)
vs one prefill + one decode worker (the router's PD mode), and one replica with a small KV pool
with and without the host KV tier.

Workload: multi-turn agents. Each agent has a long system prompt of its own (instructions and
tool descriptions, resent every turn) and runs its turns one after another, resending the whole
transcript; agents run concurrently (``--agents`` clients). Every request streams a chat
completion of at most ``--max-tokens`` tokens. Per request: TTFT (send -> first content chunk),
inter-token gaps (between content chunks), end-to-end. Throughput = completion tokens / wall time.
Prefix-cache hit rate = cached prompt tokens / prompt tokens, summed over the replicas' /metrics
(``agent_infer_prompt_tokens_cached_total`` / ``agent_infer_prompt_tokens_total``); for the PD
pair, over the prefill worker (the one that runs prompts).

The tier runs use one replica whose device pool holds about one agent's transcript, and send the
agents' turns interleaved (turn 0 of every agent, then turn 1, ...), so each agent's prefix is
evicted before its next turn: the working set exceeds the device pool.

    .venv/bin/python benchmarks/bench_cluster.py --quick     # about 5 minutes on 2 cores

Raw results: ``bench_results/cluster-<timestamp>.json``; the markdown table goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from agent_infer.cluster.processes import LocalCluster, Process, scrape, wait_healthy, wait_router_ready

ROOT = Path(__file__).resolve().parent.parent
MODEL = "SmolLM2-135M-Instruct.Q4_1"


@dataclass
class Sample:
    """One request's timings (seconds) and completion size."""

    ttft: float
    e2e: float
    gaps: list[float]
    tokens: int


@dataclass
class Result:
    """One configuration's numbers."""

    name: str
    requests: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    itl_p95_ms: float
    hit_rate: float
    samples: list[Sample] = field(default_factory=list)


def system_prompt(agent: int, words: int) -> str:
    """A long, agent-specific system prompt (what agents resend each turn)."""
    tools = " ".join(
        f"Tool t{agent}_{k}(query: string, limit: integer) looks up record {k * 31 + agent}."
        for k in range(words // 10)
    )
    return f"You are agent {agent}, a careful operations assistant. Available tools: {tools}"


def stream_chat(url: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[Sample, str]:
    """One streamed chat completion; its timings and text."""
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first: float | None = None
    last = start
    gaps: list[float] = []
    text: list[str] = []
    tokens = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                    text.append(piece)
    end = time.perf_counter()
    return Sample(ttft=(first or end) - start, e2e=end - start, gaps=gaps, tokens=tokens), "".join(text)


def run_agents(
    url: str, agents: int, turns: int, words: int, max_tokens: int, interleaved: bool
) -> list[Sample]:
    """The agent workload against ``url``: concurrent agents, or (interleaved) one turn at a time."""
    transcripts = [[{"role": "system", "content": system_prompt(a, words)}] for a in range(agents)]
    samples: list[Sample] = []
    lock = threading.Lock()

    def turn(agent: int, t: int) -> None:
        messages = transcripts[agent]
        messages.append({"role": "user", "content": f"Turn {t}: which tool do you call next, and why?"})
        sample, text = stream_chat(url, messages, max_tokens)
        messages.append({"role": "assistant", "content": text})
        with lock:
            samples.append(sample)

    if interleaved:
        for t in range(turns):
            for agent in range(agents):
                turn(agent, t)
        return samples

    def agent_loop(agent: int) -> None:
        for t in range(turns):
            turn(agent, t)

    threads = [threading.Thread(target=agent_loop, args=(a,)) for a in range(agents)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return samples


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def totals(replicas: list[Process]) -> tuple[float, float]:
    """Prompt and cached prompt tokens summed over ``replicas``."""
    prompt = cached = 0.0
    for replica in replicas:
        m = scrape(replica.url)
        prompt += m["agent_infer_prompt_tokens_total"]
        cached += m["agent_infer_prompt_tokens_cached_total"]
    return prompt, cached


def measure(
    name: str,
    url: str,
    replicas: list[Process],
    args: argparse.Namespace,
    interleaved: bool,
    flush: list[Process] | None = None,
) -> Result:
    """Flush the caches (of ``flush``, default ``replicas``), run the workload through ``url``,
    summarize; the hit rate is read from ``replicas``."""
    for replica in flush or replicas:
        httpx.post(replica.url + "/flush_cache", timeout=30).raise_for_status()
    p0, c0 = totals(replicas)
    start = time.perf_counter()
    samples = run_agents(url, args.agents, args.turns, args.words, args.max_tokens, interleaved)
    wall = time.perf_counter() - start
    p1, c1 = totals(replicas)
    gaps = [g for s in samples for g in s.gaps]
    result = Result(
        name=name,
        requests=len(samples),
        wall_s=wall,
        tokens_per_s=sum(s.tokens for s in samples) / wall,
        ttft_p50_ms=1000 * statistics.median(s.ttft for s in samples),
        ttft_p95_ms=1000 * _pct([s.ttft for s in samples], 0.95),
        itl_p95_ms=1000 * _pct(gaps, 0.95),
        hit_rate=(c1 - c0) / max(1.0, p1 - p0),
        samples=samples,
    )
    print(
        f"  {name}: {result.tokens_per_s:.1f} tok/s, TTFT p50 {result.ttft_p50_ms:.0f} ms, hit {result.hit_rate:.2f}"
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer agents and turns")
    parser.add_argument("--agents", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument(
        "--words", type=int, default=300, help="system prompt size (about words * 1.3 tokens)"
    )
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-bytes", type=int, default=128 << 20, help="device KV pool of the replicas")
    parser.add_argument(
        "--small-kv-bytes", type=int, default=36 << 20, help="device KV pool of the tier runs"
    )
    parser.add_argument("--tier-bytes", type=int, default=256 << 20, help="host KV tier of the tier run")
    args = parser.parse_args()
    args.agents = args.agents or (4 if args.quick else 8)
    args.turns = args.turns or (3 if args.quick else 5)
    common = ["--max-num-seqs", "16", "--speculative-tokens", "0"]
    results: list[Result] = []
    with tempfile.TemporaryDirectory() as logs, LocalCluster(Path(logs)) as local:
        replicas = [
            local.replica(args=[*common, "--kv-cache-memory-bytes", str(args.kv_bytes)]) for _ in range(2)
        ]
        for replica in replicas:
            wait_healthy(replica)
        results.append(measure("1 replica", replicas[0].url, replicas[:1], args, interleaved=False))
        for policy in ("round_robin", "cache_aware"):
            router = local.router([r.url for r in replicas], policy=policy)
            wait_router_ready(router, 2)
            results.append(
                measure(f"2 replicas + router ({policy})", router.url, replicas, args, interleaved=False)
            )
            router.stop()
        for replica in replicas:
            replica.stop()
        prefill = local.replica(
            args=[*common, "--kv-cache-memory-bytes", str(args.kv_bytes), "--disaggregation-mode", "prefill"]
        )
        decode = local.replica(
            args=[*common, "--kv-cache-memory-bytes", str(args.kv_bytes), "--disaggregation-mode", "decode"]
        )
        wait_healthy(prefill)
        wait_healthy(decode)
        router = local.pd_router([prefill.url], [decode.url])
        wait_router_ready(router, 2)
        results.append(
            measure(
                "1 prefill + 1 decode (PD router)",
                router.url,
                [prefill],
                args,
                False,
                flush=[prefill, decode],
            )
        )
        router.stop()
        prefill.stop()
        decode.stop()
        small = ["--kv-cache-memory-bytes", str(args.small_kv_bytes)]
        for label, extra in (("no tier", []), ("host tier", ["--host-kv-cache-bytes", str(args.tier_bytes)])):
            replica = local.replica(args=[*common, *small, *extra])
            wait_healthy(replica)
            results.append(
                measure(f"1 replica, small pool, {label}", replica.url, [replica], args, interleaved=True)
            )
            replica.stop()
    out = ROOT / "bench_results" / f"cluster-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "results": [asdict(r) for r in results]}, indent=1))
    print(f"\nagents={args.agents} turns={args.turns} max_tokens={args.max_tokens} (raw: {out})\n")
    print(
        "| configuration | requests | tok/s | TTFT p50 (ms) | TTFT p95 (ms) | inter-token p95 (ms) | prefix hit rate |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r.name} | {r.requests} | {r.tokens_per_s:.1f} | {r.ttft_p50_ms:.0f} | {r.ttft_p95_ms:.0f} "
            f"| {r.itl_p95_ms:.0f} | {r.hit_rate:.2f} |"
        )


if __name__ == "__main__":
    main()
