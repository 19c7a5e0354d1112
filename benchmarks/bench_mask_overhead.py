"""The mask path's own cost: constrained vs unconstrained decoding of the same length.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_mask_overhead.py            # ~1.5 min
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_mask_overhead.py --passes 7 --tokens 128
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_mask_overhead.py --configs masked-overlap --passes 15

Workload: ``--concurrency`` requests (default 4) submitted together, greedy, default model, forced
tokens and prompt-lookup drafts off, prefix caching off. Constrained: the schema
``{"type": "array", "items": {"type": "string"}}`` (almost every token is allowed inside a string,
so the mask saves the model nothing and costs what the mask path costs). Unconstrained reference:
the same prompts with ``ignore_eos`` and ``max_tokens`` set per request to the constrained run's
token count, so both decode exactly the same number of tokens at the same batch sizes.

Interleaving: one engine per configuration (sharing the weights); in each pass every engine gets
the pass's requests and the engines are stepped in turn, one step each, the order rotated every
round, until all are done. Step ``k`` of every engine runs the same batch, within milliseconds of
the others, so load from other processes on a shared machine falls on all configurations alike
(a drift over seconds cancels out). Clocks, summed over each engine's own steps: process CPU time
(``time.process_time``: every thread of this process, torch's and the fill thread included; on a
shared machine the trustworthy one) and wall time. Ratios are tokens per second constrained over
unconstrained (1.0 = free; the goal is >= 0.98), per pass, reported as the median over passes,
with every pass's pair listed below the table.

Where the time goes: per configuration, the CPU time of the stepping thread and of the others
(torch's workers, the fill thread); and, from ``--profile-passes`` extra passes whose timing
wrappers would bias the ratio, the stepping thread's CPU time (``time.thread_time``) in the step's
phases (forward + head, mask start, mask join + apply, sampling, postprocess with accept_token)
and the fill's own seconds (on the fill thread with overlap), per generated token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

from agent_infer import SamplingParams
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.model.loader import load_model

SCHEMA = {"type": "array", "items": {"type": "string"}}
PROMPTS = [
    "List the names of ten rivers of Europe as a JSON array of strings.",
    "Write a JSON array of short sentences describing a rainy day.",
    "Give a JSON array of strings: the steps to bake bread, in detail.",
    "Return a JSON array of strings with facts about the moon.",
    "List programming languages and what each is used for, as a JSON array of strings.",
    "Give a JSON array of strings: famous quotes about time.",
    "Write a JSON array of strings naming dishes from Italy with a short description each.",
    "Return a JSON array of strings: tips for writing clear documentation.",
]

# --configs key -> (row label, EngineConfig fields); the first is the engine's default.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "masked-overlap": ("masked head, overlap", {"masked_head": True, "async_scheduling": True}),
    "full-overlap": ("full head, overlap", {"masked_head": False, "async_scheduling": True}),
    "full-inline": ("full head, no overlap", {"masked_head": False, "async_scheduling": False}),
}
REFERENCE = "unconstrained"
PHASES = ("forward+head", "mask start", "mask join+apply", "sampling", "postprocess", "fill")


def _conversation(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


class Phases:
    """Stepping-thread CPU seconds per phase, by wrapping the engine's phase methods."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def wrapped(self, obj: Any, name: str, label: str) -> Iterator[None]:
        original = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[label] += time.thread_time() - start

        setattr(obj, name, timed)
        try:
            yield
        finally:
            setattr(obj, name, original)

    @contextmanager
    def timing(self, engine: LLMEngine) -> Iterator[None]:
        ex = engine.executor
        with ExitStack() as stack:
            stack.enter_context(self.wrapped(ex.runner, "run", "forward+head"))
            stack.enter_context(self.wrapped(ex.grammar, "start_masks", "mask start"))
            stack.enter_context(self.wrapped(ex.grammar, "apply_masks", "mask join+apply"))
            stack.enter_context(self.wrapped(ex, "sampler", "sampling"))
            stack.enter_context(self.wrapped(engine.postprocessor, "process", "postprocess"))
            yield


class Tally:
    """One configuration's totals over its own steps in one pass."""

    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0
        self.stepping = 0.0  # the stepping thread's share of cpu
        self.tokens: dict[str, int] = {}


def run_pass(
    engines: dict[str, LLMEngine], params: dict[str, list[SamplingParams]], tag: str, rotate: int = 0
) -> dict[str, Tally]:
    """Add each engine's requests, then step the engines in turn until every one is done."""
    tallies = {name: Tally() for name in engines}
    for name, engine in engines.items():
        for i, p in enumerate(params[name]):
            engine.add_request(f"{tag}-{i}", _conversation(i), p)
    names = list(engines)
    round_no = rotate
    while True:
        busy = [n for n in names if engines[n].has_unfinished_requests()]
        if not busy:
            return tallies
        round_no += 1
        k = round_no % len(busy)
        for name in busy[k:] + busy[:k]:
            tally = tallies[name]
            cpu, wall, own = time.process_time(), time.perf_counter(), time.thread_time()
            outputs = engines[name].step()
            tally.cpu += time.process_time() - cpu
            tally.wall += time.perf_counter() - wall
            tally.stepping += time.thread_time() - own
            for out in outputs:
                if out.finished:
                    tally.tokens[out.request_id] = len(out.outputs[0].token_ids)


def _fill_seconds(engine: LLMEngine) -> float:
    return engine.grammar.timings().mask_seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of the constrained requests")
    parser.add_argument("--passes", type=int, default=5)
    parser.add_argument(
        "--profile-passes", type=int, default=1, help="extra passes that time the step's phases"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated constrained configurations to run (of {', '.join(CONFIGS)})",
    )
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    chosen = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown or not chosen:
        parser.error(f"--configs: unknown {unknown} (choose from {', '.join(CONFIGS)})")
    torch.set_num_threads(args.threads)
    loaded = load_model()
    base = {
        "forced_tokens": False,
        "boundary_drafts": False,
        "speculative_tokens": 0,
        "enable_prefix_caching": False,
    }
    labels = [CONFIGS[c][0] for c in chosen]
    engines = {
        CONFIGS[c][0]: LLMEngine(config=EngineConfig.from_kwargs(**base, **CONFIGS[c][1]), loaded=loaded)
        for c in chosen
    }
    engines[REFERENCE] = LLMEngine(config=EngineConfig.from_kwargs(**base), loaded=loaded)
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=args.tokens, structured=SCHEMA)
        for _ in range(args.concurrency)
    ]
    # Warm up (grammar compile, first-call costs) and fix the lengths from the first constrained run.
    first = run_pass({labels[0]: engines[labels[0]]}, {labels[0]: constrained}, "length")[labels[0]]
    lengths = [first.tokens[f"length-{i}"] for i in range(args.concurrency)]
    reference = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    params = {**{label: constrained for label in labels}, REFERENCE: reference}
    run_pass(engines, params, "warm")
    tokens = sum(lengths)
    runs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    stepping: dict[str, list[float]] = defaultdict(list)
    for p in range(args.passes):
        tallies = run_pass(engines, params, f"pass{p}", rotate=p)
        for name, tally in tallies.items():
            got = sum(tally.tokens.values())
            if got != tokens:
                raise SystemExit(f"{name}: decoded {got} tokens, expected {tokens} (lengths not matched)")
            runs[name].append((tally.cpu, tally.wall))
            stepping[name].append(tally.stepping)
    # The phase breakdown comes from passes of its own: its wrappers cost time in the wrapped calls,
    # and the constrained engines have more of them, so they stay out of the ratio's passes.
    phases = {name: Phases() for name in engines}
    fills: dict[str, float] = defaultdict(float)
    for p in range(args.profile_passes):
        before = {name: _fill_seconds(e) for name, e in engines.items()}
        with ExitStack() as stack:
            for name, engine in engines.items():
                stack.enter_context(phases[name].timing(engine))
            run_pass(engines, params, f"profile{p}", rotate=p)
        for name, engine in engines.items():
            fills[name] += _fill_seconds(engine) - before[name]
    profiled = tokens * max(args.profile_passes, 1)
    # Paired ratios: each pass's constrained steps against the same pass's unconstrained steps.
    ref = runs[REFERENCE]
    paired = {name: [(rc / c, rw / w) for (c, w), (rc, rw) in zip(runs[name], ref)] for name in labels}
    report: dict[str, Any] = {"tokens_per_pass": tokens, "passes": args.passes, "rows": {}}
    print(f"{tokens} tokens per pass ({args.concurrency} requests), {args.passes} passes, medians")
    print(
        "| config | CPU s (stepping thread + others) | wall s | tok/CPU-s ratio | tok/s ratio | ms/token: "
        + ", ".join(PHASES)
        + " |\n|---|---|---|---|---|---|"
    )
    for name in [*labels, REFERENCE]:
        cpu = statistics.median(c for c, _ in runs[name])
        own = statistics.median(stepping[name])
        wall = statistics.median(w for _, w in runs[name])
        cpu_ratio = statistics.median(r for r, _ in paired[name]) if name in paired else 1.0
        wall_ratio = statistics.median(r for _, r in paired[name]) if name in paired else 1.0
        per_token = {k: 1000 * v / profiled for k, v in phases[name].seconds.items()}
        per_token["fill"] = 1000 * fills[name] / profiled
        report["rows"][name] = {
            "cpu_s": cpu,
            "stepping_thread_cpu_s": own,
            "wall_s": wall,
            "cpu_ratio": cpu_ratio,
            "wall_ratio": wall_ratio,
            "runs": [{"cpu_s": c, "wall_s": w} for c, w in runs[name]],
            "paired_ratios": [{"cpu": rc, "wall": rw} for rc, rw in paired.get(name, [])],
            "ms_per_token": per_token,
        }
        cells = ", ".join(f"{per_token.get(k, 0.0):.2f}" for k in PHASES)
        print(
            f"| {name} | {cpu:.2f} ({own:.2f} + {cpu - own:.2f}) | {wall:.2f} | {cpu_ratio:.3f} | {wall_ratio:.3f} | {cells} |"
        )
    print("\nEvery pass, constrained over unconstrained (CPU / wall):")
    for name in labels:
        cells = "  ".join(f"{rc:.3f}/{rw:.3f}" for rc, rw in paired[name])
        print(f"  {name:<24} {cells}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
