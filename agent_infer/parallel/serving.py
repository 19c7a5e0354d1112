"""The HTTP server over a data-parallel engine: the part of ``LLMEngine``'s surface it reads.

The server (``server/async_engine.py``) drives one engine object from its thread: requests in,
``step()``, and a snapshot of queue lengths, KV blocks and grammar timings for ``/metrics``.
:class:`ServedDataParallel` gives it those from a :class:`DataParallelEngine`: the counts are the
ranks' latest reports summed (at most 0.25 s old), ``healthy`` turns ``/health`` to 503 once a
rank failed, and :meth:`prometheus_lines` adds the parallel metrics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent_infer.engine.grammar_manager import GrammarTimings
from agent_infer.engine.llm_engine import Prompt
from agent_infer.engine.output import RequestOutput
from agent_infer.parallel.launch import DataParallelEngine
from agent_infer.sampling_params import SamplingParams


@dataclass(frozen=True)
class _Loaded:
    path: str


@dataclass(frozen=True)
class _Request:
    constraint_warnings: tuple[Any, ...]


class _Counts:
    """Queue lengths as sized placeholders (the server takes ``len`` of the scheduler's queues)."""

    def __init__(self, engine: DataParallelEngine) -> None:
        self._engine = engine

    def _sum(self, key: str) -> list[None]:
        return [None] * sum(int(s.get(key, 0)) for s in self._engine.rank_status.values())

    @property
    def waiting(self) -> list[None]:
        return self._sum("waiting")

    @property
    def waiting_for_grammar(self) -> list[None]:
        return self._sum("waiting_for_grammar")

    @property
    def running(self) -> list[None]:
        return self._sum("running")

    @property
    def num_prompt_tokens_computed(self) -> int:
        """Prompt tokens the ranks ran (not prefix-cache hits), summed over ranks."""
        return sum(int(s.get("prompt_tokens_computed", 0)) for s in self._engine.rank_status.values())

    def has_unfinished(self) -> bool:
        return self._engine.has_unfinished_requests()

    @property
    def num_blocks(self) -> int:
        return sum(int(s.get("kv_blocks_total", 0)) for s in self._engine.rank_status.values())

    @property
    def num_free_blocks(self) -> int:
        return sum(int(s.get("kv_blocks_free", 0)) for s in self._engine.rank_status.values())


class _Grammar:
    def __init__(self, engine: DataParallelEngine) -> None:
        self._engine = engine

    def timings(self) -> GrammarTimings:
        total = GrammarTimings()
        for s in self._engine.rank_status.values():
            t = s.get("grammar")
            if isinstance(t, GrammarTimings):
                total.compiles += t.compiles
                total.compile_seconds += t.compile_seconds
                total.mask_fills += t.mask_fills
                total.mask_seconds += t.mask_seconds
        return total

    def shutdown(self) -> None:
        """Each rank shuts its own grammar pool down with the rank."""


class ServedDataParallel:
    """A :class:`DataParallelEngine` with the attributes the server reads of an ``LLMEngine``."""

    def __init__(self, engine: DataParallelEngine) -> None:
        self.dp = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.eos_token_ids = engine.eos_token_ids
        self.loaded = _Loaded(engine.model_path)
        counts = _Counts(engine)
        self.scheduler = counts
        self.block_manager = counts
        self.grammar = _Grammar(engine)

    @property
    def healthy(self) -> bool:
        """False once a rank failed."""
        return self.dp.healthy

    @property
    def requests(self) -> dict[str, _Request]:
        """Unfinished requests, with their constraint's warnings."""
        return {k: _Request(v) for k, v in self.dp.constraint_warnings.items()}

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> None:
        """:meth:`DataParallelEngine.add_request`."""
        self.dp.add_request(request_id, prompt, params)

    def abort(self, request_id: str) -> None:
        """:meth:`DataParallelEngine.abort`."""
        self.dp.abort(request_id)

    def step(self) -> list[RequestOutput]:
        """:meth:`DataParallelEngine.step`."""
        return self.dp.step()

    def has_unfinished_requests(self) -> bool:
        """:meth:`DataParallelEngine.has_unfinished_requests`."""
        return self.dp.has_unfinished_requests()

    def shutdown(self) -> None:
        """Stop the rank processes."""
        self.dp.shutdown()

    def prometheus_lines(self, prefix: str = "agent_infer") -> list[str]:
        """The parallel metrics in Prometheus text format: ranks, health, per-rank requests and
        generated tokens and weight bytes; context-parallel prefills (count, tokens, time); under
        expert parallelism per-rank tokens per step, all-to-all bytes per step, the expert
        imbalance of the last rebalance and the rebalance count."""
        dp = self.dp
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            full = f"{prefix}_parallel_{name}"
            lines.extend((f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"))
            lines.extend(f"{full}{labels} {value:g}" for labels, value in samples)

        metric("ranks", "gauge", "Rank processes of the data-parallel engine.", [("", dp.world_size)])
        metric("healthy", "gauge", "1 while every rank is alive.", [("", 1.0 if dp.healthy else 0.0)])
        per_rank = dp.requests_per_rank()
        metric(
            "rank_requests",
            "gauge",
            "Unfinished requests per rank.",
            [(f'{{rank="{r}"}}', n) for r, n in enumerate(per_rank)],
        )
        metric(
            "rank_generated_tokens_total",
            "counter",
            "Tokens generated per rank.",
            [(f'{{rank="{r}"}}', n) for r, n in enumerate(dp.generated_tokens)],
        )
        prefills = {
            r: st["cp_prefill"] for r, st in dp.rank_status.items() if st.get("cp_prefill") is not None
        }
        if prefills:
            metric(
                "cp_prefills_total",
                "counter",
                "Context-parallel prefills (each run by every rank).",
                [("", max(p.prefills for p in prefills.values()))],
            )
            metric(
                "cp_prefill_tokens_total",
                "counter",
                "Prompt tokens prefilled context-parallel.",
                [("", max(p.tokens for p in prefills.values()))],
            )
            metric(
                "cp_prefill_seconds_total",
                "counter",
                "Wall time each rank spent in context-parallel prefills.",
                [(f'{{rank="{r}"}}', p.seconds) for r, p in sorted(prefills.items())],
            )
            metric(
                "cp_prefill_last_seconds",
                "gauge",
                "Wall time of the last context-parallel prefill (slowest rank).",
                [("", max(p.last_seconds for p in prefills.values()))],
            )
        held = {r: st["weight_bytes"] for r, st in dp.rank_status.items() if "weight_bytes" in st}
        if held:
            metric(
                "rank_weight_bytes",
                "gauge",
                "Bytes of weights each rank holds (under expert parallelism: its expert slots only).",
                [(f'{{rank="{r}"}}', n) for r, n in sorted(held.items())],
            )
        reports = {r: m for r, m in dp.rank_metrics.items() if m is not None}
        if not reports:
            return lines
        first = reports[min(reports)]
        steps = max(first.steps, 1)
        metric(
            "rank_tokens_per_step",
            "gauge",
            "Tokens each rank fed per lock-step step (mean over busy steps).",
            [(f'{{rank="{r}"}}', n / steps) for r, n in enumerate(first.total_tokens_per_rank)],
        )
        metric(
            "alltoall_bytes_per_step",
            "gauge",
            "All-to-all bytes a rank sent per busy step (MoE dispatch and combine).",
            [(f'{{rank="{r}"}}', m.dispatch_bytes_per_step) for r, m in sorted(reports.items())],
        )
        metric("eplb_rebalances_total", "counter", "EPLB rebalances.", [("", first.rebalances)])
        if first.imbalance_history:
            before, after = first.imbalance_history[-1]
            metric(
                "expert_imbalance",
                "gauge",
                "Expert load imbalance (max/mean rank load) of the last rebalance's window.",
                [('{when="before"}', before), ('{when="after"}', after)],
            )
        return lines
