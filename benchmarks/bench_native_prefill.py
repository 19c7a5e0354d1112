"""Prefill time of long prompts on the default model: SDPA vs the native tiled attention kernel.

Run: ``OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_native_prefill.py [--lengths 1000 2000 4000]
[--reps 3] [--threads 2]``.

Both peers are the same model (SmolLM2-135M GGUF, native float32 path, same packed linears and
RoPE); only the attention route differs: ``max_native_query = 0`` sends every chunk through torch
SDPA, the default sends every row through the native kernel (rows tiled, each row computed as
decoding that token alone). One whole-prompt prefill per measurement, the peers interleaved within
each repetition, medians over ``--reps``; the ratio native/SDPA is what the invariant route costs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from agent_infer.model.layers import native_ops
from agent_infer.model.layers.attention import NATIVE_MAX_QUERY, NativePagedAttention
from agent_infer.model.loader import default_model_path, load_model
from agent_infer.model.runner import SequenceRunner


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native_ops.set_num_threads(args.threads)
    lm = load_model(default_model_path(), device=torch.device("cpu"), dtype=torch.float32)
    attention = lm.model.kernels.attention
    if not isinstance(attention, NativePagedAttention):
        sys.exit("the default model did not load on the native path (extension missing?)")
    peers = {"sdpa": 0, "native": NATIVE_MAX_QUERY}
    gen = torch.Generator().manual_seed(0)
    print("| prompt tokens | SDPA ms | native ms | native / SDPA |")
    print("|---|---|---|---|")
    for n in args.lengths:
        prompt = torch.randint(100, 40000, (n,), generator=gen).tolist()
        times: dict[str, list[float]] = {p: [] for p in peers}
        for rep in range(args.reps + 1):  # the first repetition warms up
            for name, limit in peers.items():
                attention.max_native_query = limit
                runner = SequenceRunner(lm.model, num_blocks=n // 16 + 4, block_size=16)
                start = time.perf_counter()
                runner.step([(0, prompt)])
                if rep:
                    times[name].append(time.perf_counter() - start)
                print(f"{n} {name} rep {rep}: {time.perf_counter() - start:.2f} s", file=sys.stderr)
        sdpa, native = statistics.median(times["sdpa"]), statistics.median(times["native"])
        print(f"| {n} | {sdpa * 1e3:.0f} | {native * 1e3:.0f} | {native / sdpa:.2f} |")
    attention.max_native_query = NATIVE_MAX_QUERY


if __name__ == "__main__":
    main()
