"""Where a batch fill's wall time goes: bench_grammar.py's ``--batch`` rows, in process, with the
native batch timeline (``agent_infer._native.grammar_batch_trace``).

Replays the same steps twice from cold caches, as the benchmark does: once as one native batch
fill on one thread (the rows' cost without the pool), once on ``--threads`` threads with the
timeline on. Prints the totals (wall and process CPU per pass), the thread time left idle inside
the threaded batches, and which schemas' rows ran alone while it was idle (a first visit whose
work one thread had to do by itself), then the steps with the most idle time.

    python benchmarks/profile_batch.py --tokenizer deepseek --limit 200 --seed 0
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_grammar as bg
from grammar_peers import OursEngine


def _replay(
    engine: OursEngine, rows: list[tuple[Any, Any, list[int], int]], steps: int, threads: int, trace: bool
) -> tuple[float, float, list[list[tuple[str, int, int, int, int]]], list[float]]:
    """Fills `steps` steps from fresh matchers; returns wall and CPU seconds, per-step events and
    per-step wall seconds."""
    from agent_infer import _native

    native, _ = engine.allocate(len(rows))
    matchers = engine.restart([r[0] for r in rows], [r[1] for r in rows])
    pos = []
    for m, (_, _, toks, start) in zip(matchers, rows):
        for t in toks[:start]:
            m.accept(t)
        pos.append(start)
    wall = cpu = 0.0
    events: list[list[tuple[str, int, int, int, int]]] = []
    per_step: list[float] = []
    for _ in range(steps):
        if trace:
            _native.grammar_batch_trace(True)
        c, w = time.process_time(), time.perf_counter()
        engine.batch_fill(matchers, native, threads)
        per_step.append(time.perf_counter() - w)
        wall += per_step[-1]
        cpu += time.process_time() - c
        if trace:
            events.append(_native.grammar_batch_trace(False))
        for i, (m, (_, _, toks, _)) in enumerate(zip(matchers, rows)):
            if pos[i] >= len(toks) or not m.accept(toks[pos[i]]):
                m.reset()
                pos[i] = 0
            else:
                pos[i] += 1
    return wall, cpu, events, per_step


def _idle(
    step: list[tuple[str, int, int, int, int]], threads: int, slot_ns: int = 5000
) -> tuple[float, dict[int, float]]:
    """Idle thread-µs of one batch, and per row the idle µs while it was the row running."""
    batch = [e for e in step if e[0] == "b"]
    if not batch:
        return 0.0, {}
    t0, t1 = batch[0][3], batch[0][4]
    busy = [e for e in step if e[0] in "rp"]
    rows = [e for e in step if e[0] == "r"]
    idle = 0.0
    blame: dict[int, float] = defaultdict(float)
    for t in range(t0, t1, slot_ns):
        active = {e[2] for e in busy if e[3] <= t < e[4]}
        missing = threads - len(active)
        if missing <= 0:
            continue
        idle += missing * slot_ns / 1e3
        running = [e[1] for e in rows if e[3] <= t < e[4]]
        if running:
            blame[running[0]] += missing * slot_ns / 1e3
    return idle, blame


def main() -> int:
    """Runs both passes and prints the breakdown."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bg.add_sample_args(ap)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=10, help="schemas and steps listed")
    ap.add_argument("--show", type=int, default=None, help="print the timeline of this step")
    args = ap.parse_args()

    spec = bg.prepare_tokenizer(args.tokenizer)
    schemas = bg.load_schemas(Path(args.data), args.limit, args.seed)
    task = bg.batch_task(spec, schemas, args.batch, "different", args.seed)
    if task is None:
        print("no schema with a valid instance")
        return 1
    engine = OursEngine(spec)
    engine.allocate(1)
    gc.collect()
    gc.freeze()  # as the benchmark's workers do
    rows, row_ids, _ = bg.batch_rows(engine, task)

    one_wall, one_cpu, _, one_steps = _replay(engine, rows, args.steps, 1, False)
    wall, cpu, events, steps = _replay(engine, rows, args.steps, args.threads, True)
    print(f"{len(rows)} rows, {args.steps} steps, {args.tokenizer}")
    print(f"one thread : wall {one_wall * 1e3:8.1f} ms  CPU {one_cpu * 1e3:8.1f} ms")
    print(
        f"{args.threads} threads  : wall {wall * 1e3:8.1f} ms  CPU {cpu * 1e3:8.1f} ms  "
        f"(wall ratio {wall / one_wall:.2f}, CPU ratio {cpu / one_cpu:.2f})"
    )
    # The benchmark's figure is the per-step median of this ratio (against Python's one-by-one
    # fills there, which add a call's overhead per row; here the one-thread pass is native).
    ratios = sorted(b / a for a, b in zip(one_steps, steps) if a > 0)
    if ratios:
        print(
            f"per-step wall ratio: p10 {ratios[len(ratios) // 10]:.2f}  p50 {ratios[len(ratios) // 2]:.2f}  "
            f"p90 {ratios[len(ratios) * 9 // 10]:.2f}"
        )
    total_idle = 0.0
    by_schema: dict[str, float] = defaultdict(float)
    per_step: list[tuple[float, int, dict[str, float]]] = []
    for k, step in enumerate(events):
        idle, blame = _idle(step, args.threads)
        total_idle += idle
        named: dict[str, float] = defaultdict(float)
        for row, us in blame.items():
            by_schema[row_ids[row]] += us
            named[row_ids[row]] += us
        per_step.append((idle, k, dict(named)))
    print(f"idle thread time inside the threaded batches: {total_idle / 1e3:.1f} ms")
    waits = [e for step in events for e in step if e[0] == "w"]
    print(
        f"rows waiting for parts other threads ran (inside their row): {sum(e[4] - e[3] for e in waits) / 1e6:.1f} ms "
        f"in {len(waits)} waits"
    )
    print("\nidle while one schema's row ran (ms):")
    for name, us in sorted(by_schema.items(), key=lambda x: -x[1])[: args.top]:
        print(f"  {us / 1e3:7.2f}  {name}")
    print("\nsteps with the most idle time (µs):")
    for idle, k, named in sorted(per_step, reverse=True)[: args.top]:
        top = ", ".join(f"{n} {us:.0f}" for n, us in sorted(named.items(), key=lambda x: -x[1])[:2])
        print(f"  step {k:3d}: idle {idle:7.0f}  ({top})")
    if args.show is not None and args.show < len(events):
        step = sorted(events[args.show], key=lambda e: e[3])
        start = min(e[3] for e in step)
        print(f"\nstep {args.show} (µs from the batch's start; rows over 50 µs and every part):")
        for kind, index, thread, t0, t1 in step:
            if kind == "p" or (kind == "r" and t1 - t0 > 50_000):
                name = row_ids[index] if kind == "r" else ""
                print(
                    f"  {kind} {index:3d} thread {thread}  {(t0 - start) / 1e3:8.0f} +{(t1 - t0) / 1e3:7.0f}  {name}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
