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

Order: each pass runs every configuration once, rotated per pass, so load from other processes on
a shared machine hits them alike. Clocks: process CPU time (``time.process_time``: every thread of
this process, torch's and the fill thread included; on a shared machine the trustworthy one) and
wall time. Ratios are tokens per second constrained over unconstrained (1.0 = free; the goal is
>= 0.98), taken per pass between the two runs of that pass and reported as the median over
passes, with every pass's pair listed below the table.

Where the time goes: per configuration, the stepping thread's CPU time (``time.thread_time``) in
the step's phases (forward + head, mask join + apply, sampling, postprocess with accept_token),
and the fill's own seconds (on the fill thread with overlap), per generated token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from agent_infer import SamplingParams
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.llm import LLM
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


def _conversations(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(n)]


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


def run_once(
    llm: LLM, params: list[SamplingParams], phases: Phases | None
) -> tuple[list[int], float, float, float]:
    """(tokens per request, CPU s, wall s, fill-thread s) of one batched generate."""
    engine = llm.engine
    fill_before = engine.grammar.timings().mask_seconds if hasattr(engine.grammar, "timings") else 0.0
    cpu, wall = time.process_time(), time.perf_counter()
    if phases is None:
        outs = llm.chat(_conversations(len(params)), params)
    else:
        ex = engine.executor
        with (
            phases.wrapped(ex.runner, "run", "forward+head"),
            phases.wrapped(ex.grammar, "apply_masks", "mask join+apply"),
            phases.wrapped(ex, "sampler", "sampling"),
            phases.wrapped(engine.postprocessor, "process", "postprocess"),
        ):
            outs = llm.chat(_conversations(len(params)), params)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    fill_after = engine.grammar.timings().mask_seconds if hasattr(engine.grammar, "timings") else 0.0
    return [len(o.token_ids) for o in outs], cpu, wall, fill_after - fill_before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128, help="max_tokens of the constrained requests")
    parser.add_argument("--passes", type=int, default=5)
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
    configs = {CONFIGS[c][0]: CONFIGS[c][1] for c in chosen}
    base = {
        "forced_tokens": False,
        "boundary_drafts": False,
        "speculative_tokens": 0,
        "enable_prefix_caching": False,
    }
    llms = {
        name: LLM.from_engine(LLMEngine(config=EngineConfig.from_kwargs(**base, **c), loaded=loaded))
        for name, c in configs.items()
    }
    plain = LLM.from_engine(LLMEngine(config=EngineConfig.from_kwargs(**base), loaded=loaded))
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=args.tokens, structured=SCHEMA)
        for _ in range(args.concurrency)
    ]
    # Warm up (grammar compile, first-call costs) and fix the lengths from the first constrained run.
    lengths, *_ = run_once(llms[next(iter(configs))], constrained, None)
    for llm in llms.values():
        run_once(llm, constrained, None)
    reference = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    run_once(plain, reference, None)
    tokens = sum(lengths)
    runs: dict[str, list[tuple[float, float]]] = defaultdict(list)
    phases = {name: Phases() for name in [*configs, "unconstrained"]}
    fills: dict[str, float] = defaultdict(float)
    order: list[tuple[str, Callable[[Phases | None], tuple[list[int], float, float, float]]]] = [
        *((name, lambda ph, llm=llm: run_once(llm, constrained, ph)) for name, llm in llms.items()),
        ("unconstrained", lambda ph: run_once(plain, reference, ph)),
    ]
    for p in range(args.passes):
        for name, fn in order[p % len(order) :] + order[: p % len(order)]:
            got, cpu, wall, fill = fn(phases[name])
            if sum(got) != tokens:
                raise SystemExit(
                    f"{name}: decoded {sum(got)} tokens, expected {tokens} (lengths not matched)"
                )
            runs[name].append((cpu, wall))
            fills[name] += fill
    # Paired ratios: each pass's constrained run against the same pass's unconstrained run, which
    # ran next to it in time (a drift in the machine's load cancels out of the pair).
    ref = runs["unconstrained"]
    paired = {name: [(rc / c, rw / w) for (c, w), (rc, rw) in zip(runs[name], ref)] for name in configs}
    report: dict[str, Any] = {"tokens_per_pass": tokens, "passes": args.passes, "rows": {}}
    print(f"{tokens} tokens per pass ({args.concurrency} requests), {args.passes} passes, medians")
    print(
        "| config | CPU s | wall s | tok/CPU-s ratio | tok/s ratio | ms/token: forward+head, mask join+apply, sampling, postprocess, fill |"
    )
    print("|---|---|---|---|---|---|")
    for name in [*configs, "unconstrained"]:
        cpu = statistics.median(c for c, _ in runs[name])
        wall = statistics.median(w for _, w in runs[name])
        cpu_ratio = statistics.median(r for r, _ in paired[name]) if name in paired else 1.0
        wall_ratio = statistics.median(r for _, r in paired[name]) if name in paired else 1.0
        per_token = {k: 1000 * v / (tokens * args.passes) for k, v in phases[name].seconds.items()}
        per_token["fill"] = 1000 * fills[name] / (tokens * args.passes)
        report["rows"][name] = {
            "cpu_s": cpu,
            "wall_s": wall,
            "cpu_ratio": cpu_ratio,
            "wall_ratio": wall_ratio,
            "runs": [{"cpu_s": c, "wall_s": w} for c, w in runs[name]],
            "paired_ratios": [{"cpu": rc, "wall": rw} for rc, rw in paired.get(name, [])],
            "ms_per_token": per_token,
        }
        cells = ", ".join(
            f"{per_token.get(k, 0.0):.2f}"
            for k in ("forward+head", "mask join+apply", "sampling", "postprocess", "fill")
        )
        print(f"| {name} | {cpu:.2f} | {wall:.2f} | {cpu_ratio:.3f} | {wall_ratio:.3f} | {cells} |")
    print("\nEvery pass, constrained over unconstrained (CPU / wall):")
    for name in configs:
        cells = "  ".join(f"{rc:.3f}/{rw:.3f}" for rc, rw in paired[name])
        print(f"  {name:<24} {cells}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
