"""Server counters rendered as Prometheus text (exposition format 0.0.4), without a client library.

Counters are bumped from two threads (handlers on the event loop, the engine thread), so one lock
guards them; a scrape reads a consistent copy.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import TYPE_CHECKING

from agent_infer.engine.output import RequestOutput

if TYPE_CHECKING:
    from agent_infer.server.async_engine import EngineSnapshot

_PREFIX = "agent_infer"


class ServerMetrics:
    """Request, token, latency and engine-step counters of one server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: Counter[tuple[str, int]] = Counter()
        self._finish: Counter[str] = Counter()
        self._sums: dict[str, float] = dict.fromkeys(
            (
                "prompt_tokens",
                "cached_prompt_tokens",
                "generation_tokens",
                "forced_tokens",
                "draft_tokens",
                "accepted_draft_tokens",
                "compile_s",
                "step_s",
                "ttft_s",
                "e2e_s",
            ),
            0.0,
        )
        self._counts: Counter[str] = Counter()
        #: Per draft source: draft tokens verified, accepted, and verifications.
        self._drafts: dict[str, list[int]] = {}

    def observe_request(self, endpoint: str, status: int) -> None:
        """One HTTP request answered with ``status``."""
        with self._lock:
            self._requests[(endpoint, status)] += 1

    def observe_finished(self, output: RequestOutput) -> None:
        """A request finished in the engine: tokens, finish reason, latencies."""
        m = output.metrics
        with self._lock:
            self._finish[output.finish_reason or "unknown"] += 1
            self._sums["prompt_tokens"] += len(output.prompt_token_ids)
            self._sums["cached_prompt_tokens"] += output.num_cached_tokens
            self._sums["generation_tokens"] += len(output.token_ids)
            self._sums["forced_tokens"] += m.num_forced_tokens
            self._sums["draft_tokens"] += m.num_draft_tokens
            self._sums["accepted_draft_tokens"] += m.num_accepted_draft_tokens
            for source, stats in m.draft_sources.items():
                row = self._drafts.setdefault(source, [0, 0, 0])
                row[0] += stats.drafted
                row[1] += stats.accepted
                row[2] += stats.verifications
            if m.first_token_time is not None:
                self._sums["ttft_s"] += m.first_token_time - m.arrival_time
                self._counts["ttft_s"] += 1
            if m.finished_time is not None:
                self._sums["e2e_s"] += m.finished_time - m.arrival_time
                self._counts["e2e_s"] += 1

    def observe_compile(self, seconds: float) -> None:
        """Time ``add_request`` took for a constrained request (grammar lowering and compilation)."""
        with self._lock:
            self._sums["compile_s"] += seconds
            self._counts["compile_s"] += 1

    def observe_step(self, seconds: float) -> None:
        """One engine step (forward, masks, sampling, postprocess)."""
        with self._lock:
            self._sums["step_s"] += seconds
            self._counts["step_s"] += 1

    def render(self, snapshot: EngineSnapshot, active_streams: int) -> str:
        """The Prometheus text of every metric."""
        with self._lock:
            requests = dict(self._requests)
            finish = dict(self._finish)
            sums = dict(self._sums)
            counts = dict(self._counts)
            drafts = {source: list(row) for source, row in self._drafts.items()}
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            full = f"{_PREFIX}_{name}"
            lines.append(f"# HELP {full} {help_text}")
            lines.append(f"# TYPE {full} {kind}")
            for labels, value in samples:
                lines.append(f"{full}{labels} {_number(value)}")

        metric(
            "http_requests_total",
            "counter",
            "HTTP requests by endpoint and status code.",
            [(f'{{endpoint="{e}",status="{s}"}}', v) for (e, s), v in sorted(requests.items())],
        )
        metric(
            "requests_finished_total",
            "counter",
            "Engine requests finished, by finish reason.",
            [(f'{{finish_reason="{r}"}}', v) for r, v in sorted(finish.items())],
        )
        metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests.",
            [("", sums["prompt_tokens"])],
        )
        metric(
            "prompt_tokens_cached_total",
            "counter",
            "Prompt tokens of finished requests served by the prefix cache (prefix-cache hits).",
            [("", sums["cached_prompt_tokens"])],
        )
        metric(
            "generation_tokens_total",
            "counter",
            "Generated tokens of finished requests.",
            [("", sums["generation_tokens"])],
        )
        metric(
            "forced_tokens_total",
            "counter",
            "Generated tokens appended by jump-forward (grammar-forced, not sampled).",
            [("", sums["forced_tokens"])],
        )
        metric(
            "draft_tokens_total",
            "counter",
            "Speculative draft tokens verified by the model.",
            [("", sums["draft_tokens"])],
        )
        metric(
            "accepted_draft_tokens_total",
            "counter",
            "Speculative draft tokens the model accepted.",
            [("", sums["accepted_draft_tokens"])],
        )
        metric(
            "prompt_tokens_computed_total",
            "counter",
            "Prompt tokens the model ran here (not prefix-cache hits, not KV read from a prefill worker).",
            [("", snapshot.prompt_tokens_computed)],
        )
        for name, col, text in (
            ("source_draft_tokens_total", 0, "Speculative draft tokens verified, by draft source."),
            ("source_accepted_draft_tokens_total", 1, "Speculative draft tokens accepted, by draft source."),
            (
                "draft_verifications_total",
                2,
                "Verifications of a draft (steps that fed one), by draft source.",
            ),
        ):
            metric(name, "counter", text, [(f'{{source="{k}"}}', v[col]) for k, v in sorted(drafts.items())])
        metric("requests_waiting", "gauge", "Requests queued for admission.", [("", snapshot.waiting)])
        metric(
            "requests_waiting_for_grammar",
            "gauge",
            "Requests whose grammar is still compiling.",
            [("", snapshot.waiting_for_grammar)],
        )
        metric("requests_running", "gauge", "Requests in the running batch.", [("", snapshot.running)])
        metric("active_streams", "gauge", "Requests with a waiting HTTP client.", [("", active_streams)])
        metric("kv_blocks_total", "gauge", "KV-cache blocks in the pool.", [("", snapshot.kv_blocks_total)])
        metric(
            "kv_blocks_free", "gauge", "KV-cache blocks owned by no request.", [("", snapshot.kv_blocks_free)]
        )
        metric(
            "kv_blocks_used",
            "gauge",
            "KV-cache blocks owned by live requests.",
            [("", snapshot.kv_blocks_total - snapshot.kv_blocks_free)],
        )
        for key, name, help_text in (
            (
                "compile_s",
                "grammar_admission_seconds",
                "add_request time of constrained requests (lowering the constraint, queueing its compile).",
            ),
            ("step_s", "engine_step_seconds", "Engine step time (forward, masks, sampling)."),
            ("ttft_s", "time_to_first_token_seconds", "Engine arrival to first token."),
            ("e2e_s", "request_latency_seconds", "Engine arrival to finish."),
        ):
            # A summary's samples are NAME_sum and NAME_count: the suffix rides in the label slot.
            metric(name, "summary", help_text, [("_sum", sums[key]), ("_count", counts.get(key, 0))])
        timings = snapshot.grammar
        metric(
            "grammar_compile_seconds",
            "summary",
            "Token-level grammar compiles in the engine's worker pool (cache hits included).",
            [("_sum", timings.compile_seconds), ("_count", timings.compiles)],
        )
        metric(
            "grammar_mask_seconds",
            "summary",
            "Token-bitmask fills, one per engine step with constrained rows.",
            [("_sum", timings.mask_seconds), ("_count", timings.mask_fills)],
        )
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))
