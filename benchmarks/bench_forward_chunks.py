"""Cost of one forward pass by chunk length: what a forced run or a draft adds to a decode step.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_forward_chunks.py [--threads 2]

One sequence with a ~270-token chat prompt in the KV cache; each measurement feeds ``k`` new
tokens after it (then rewinds, so every pass sees the same context) and records the process CPU
time of the pass (the trustworthy clock on a shared machine). Chunk rows attend either through
SDPA (``max_native_query = 1``: only single tokens take the native kernel) or row by row through
the native decode kernel (the engine's setting); the two run interleaved, and medians are printed.
The default model (SmolLM2-135M GGUF), float32, the packed native linears.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import statistics
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    """Print the median CPU ms per forward for each chunk length and attention route."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from agent_infer.model.layers.native_ops import thread_budget
    from agent_infer.model.loader import load_model
    from agent_infer.model.runner import SequenceRunner

    lm = load_model()
    tok = lm.tokenizer
    text = "Describe a person as JSON with name, age, city and a list of hobbies. " * 14
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
    attention = lm.model.kernels.attention
    engine_limit = attention.max_native_query
    routes = {"SDPA": 1, "native rows": engine_limit}
    runner = SequenceRunner(lm.model, num_blocks=128)
    samples: dict[tuple[str, int], list[float]] = {}
    try:
        with thread_budget():
            runner.step([(0, prompt)])
            base = runner._lens[0]
            for _ in range(args.repeats):
                for k in args.chunks:
                    for name, limit in routes.items():
                        attention.max_native_query = limit
                        t = time.process_time()
                        runner.step([(0, list(range(1000, 1000 + k)))])
                        samples.setdefault((name, k), []).append((time.process_time() - t) * 1e3)
                        runner._lens[0] = base  # rewind: the next pass sees the same context
    finally:
        attention.max_native_query = engine_limit
    print(f"context {len(prompt)} tokens, {args.threads} threads, process CPU ms per forward (median)")
    print("| chunk | " + " | ".join(routes) + " |")
    print("|---|" + "---|" * len(routes))
    for k in args.chunks:
        cells = " | ".join(f"{statistics.median(samples[(name, k)]):.2f}" for name in routes)
        print(f"| {k} | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
