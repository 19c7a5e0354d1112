"""What two busy CPUs of this machine can do at once: independent workloads alone and side by side.

The batch target (``bench_grammar.py --batch 64 --threads 2``) divides a two-thread batch fill by
a one-thread pass. On a virtual machine the two vCPUs may share more than they show (a memory
system used by other guests, one physical core): then two busy vCPUs are slower than one, and
no scheduling recovers it. This probe measures that directly, with processes that share
nothing: each pinned to one CPU, each repeating the same work, first one CPU alone, then all of
them at once (started together). Workloads:

* ``alu``: integer arithmetic on a few KB (L1-resident): the cores alone.
* ``copy``: 64 rows of 16 KB gathered from an 8 MB pool per call, about the bytes a cached
  64-row DeepSeek-V4 mask fill moves: the memory system.
* ``fill``: that cached fill itself (64 MaskBench matchers at mid-document positions, one
  thread, ``fill_next_token_bitmask_batch``).

Prints per workload the median ms per call of each CPU alone and side by side, and the slowdown.

    python benchmarks/probe_cpus.py                 # all three, all CPUs (≈ 1 min here)
    python benchmarks/probe_cpus.py --work copy,alu --rounds 5
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

WORKS = ("alu", "copy", "fill")


def _alu() -> Callable[[], None]:
    a = np.arange(1024, dtype=np.uint64)

    def run() -> None:
        x = a
        for _ in range(2000):
            x = x * np.uint64(6364136223846793005) + np.uint64(1442695040888963407)

    return run


def _copy() -> Callable[[], None]:
    rows, words = 64, 4096  # 16 KB rows
    pool = np.ones(((8 << 20) // (words * 4), words), dtype=np.int32)
    out = np.empty((rows, words), dtype=np.int32)
    state = {"k": 0}

    def run() -> None:
        for _ in range(8):
            k = state["k"]
            idx = (np.arange(rows) * 7 + k) % len(pool)
            np.take(pool, idx, axis=0, out=out)
            state["k"] = k + rows

    return run


def _fill() -> Callable[[], None]:
    import bench_grammar as bg
    from grammar_peers import OursEngine

    spec = bg.prepare_tokenizer("deepseek")
    schemas = bg.load_schemas(bg.DEFAULT_DATA, 200, 0)
    task = bg.batch_task(spec, schemas, 64, "different", 0)
    if task is None:
        raise SystemExit("no schema with a valid instance")
    engine = OursEngine(spec)
    engine.allocate(1)
    rows, _, _ = bg.batch_rows(engine, task)
    bitmask, _ = engine.allocate(len(rows))
    matchers = [r[0] for r in rows]
    engine.batch_fill(matchers, bitmask, 1)  # first visits happen here, not in the timing
    gc.collect()
    gc.freeze()

    def run() -> None:
        for _ in range(20):
            engine.batch_fill(matchers, bitmask, 1)

    return run


def _worker(work: str, cpu: int, start: float, calls: int, out: Any) -> None:
    """Pins itself to `cpu`, builds the workload, waits for `start`, then times `calls` calls."""
    os.sched_setaffinity(0, {cpu})
    run = {"alu": _alu, "copy": _copy, "fill": _fill}[work]()
    run()  # warm
    while time.time() < start:
        time.sleep(0.001)
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        run()
        times.append((time.perf_counter() - t) * 1e3)
    out.put((cpu, statistics.median(times)))


def _round(work: str, cpus: list[int], calls: int, setup_s: float) -> dict[int, float]:
    """Median ms per call on each of `cpus`, all started together."""
    ctx = mp.get_context("spawn")
    q: Any = ctx.Queue()
    start = time.time() + setup_s
    procs = [ctx.Process(target=_worker, args=(work, c, start, calls, q)) for c in cpus]
    for p in procs:
        p.start()
    got = dict(q.get() for _ in procs)
    for p in procs:
        p.join()
    return got


def main() -> int:
    """Runs the probe and prints the table."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default=",".join(WORKS), help=f"comma-separated: {', '.join(WORKS)}")
    ap.add_argument("--rounds", type=int, default=3, help="alone/together rounds, alternating")
    ap.add_argument("--calls", type=int, default=30, help="timed calls per process and round")
    args = ap.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    works = [w for w in args.work.split(",") if w]
    for w in works:
        if w not in WORKS:
            ap.error(f"unknown workload {w!r}")
    print(f"CPUs {cpus}; median ms per call, {args.rounds} rounds of {args.calls} calls\n")
    print("| workload | CPU | alone | side by side | slowdown |")
    print("|---|---|---|---|---|")
    for w in works:
        setup = 25.0 if w == "fill" else 3.0  # the fill compiles 64 grammars first
        alone: dict[int, list[float]] = {c: [] for c in cpus}
        paired: dict[int, list[float]] = {c: [] for c in cpus}
        for _ in range(args.rounds):
            for c in cpus:
                alone[c].append(_round(w, [c], args.calls, setup)[c])
            for c, ms in _round(w, cpus, args.calls, setup).items():
                paired[c].append(ms)
        for c in cpus:
            a, p = statistics.median(alone[c]), statistics.median(paired[c])
            print(f"| {w} | {c} | {a:.2f} | {p:.2f} | {p / a:.2f}× |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
