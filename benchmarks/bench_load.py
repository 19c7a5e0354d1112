"""Measure model load time (metadata + weights + tokenizer) and batch-1 decode speed.

Run: ``OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_load.py [MODEL] [--decode N]``.
Load 1 is the first in a fresh process (first-touch of the mapped file and of torch's kernels);
later loads are warm. Import time of torch and agent_infer is printed separately.
"""

from __future__ import annotations

import argparse
import time

_T0 = time.perf_counter()

import torch  # noqa: E402 - imports are timed

from agent_infer.model.loader import LoadedModel, load_model  # noqa: E402
from agent_infer.model.runner import SequenceRunner  # noqa: E402

_IMPORT_S = time.perf_counter() - _T0


def decode_speed(lm: LoadedModel, steps: int) -> float:
    """Greedy batch-1 decode tokens/s after a short chat prefill (block size 16)."""
    tok = lm.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me a story."}]))
    runner = SequenceRunner(lm.model, num_blocks=-(-(len(prompt) + steps + 1) // 16), block_size=16)
    nxt = int(runner.step([(0, prompt)])[0].argmax())
    t = time.perf_counter()
    for _ in range(steps):
        nxt = int(runner.step([(0, [nxt])])[0].argmax())
    return steps / (time.perf_counter() - t)


def batch_decode_speed(lm: LoadedModel, steps: int, batch: int) -> float:
    """Aggregate tokens/s when ``batch`` sequences of different prompt lengths decode together."""
    tok = lm.tokenizer
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": "Tell me a story. " * (i + 1)}]))
        for i in range(batch)
    ]
    blocks = sum(-(-(len(p) + steps + 1) // 16) for p in prompts)
    runner = SequenceRunner(lm.model, num_blocks=blocks, block_size=16)
    nxt = runner.step(list(enumerate(prompts))).argmax(-1).tolist()
    t = time.perf_counter()
    for _ in range(steps):
        nxt = runner.step([(i, [nxt[i]]) for i in range(batch)]).argmax(-1).tolist()
    return batch * steps / (time.perf_counter() - t)


def main() -> None:
    """Load the model a few times and print timings."""
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument(
        "--batch", type=int, default=8, help="also time decode with this many sequences (0: skip)"
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    print(f"import torch + agent_infer.model: {_IMPORT_S:.2f} s")
    lm = None
    for i in range(args.repeat):
        t = time.perf_counter()
        lm = load_model(args.model, dtype=getattr(torch, args.dtype))
        print(f"load {i + 1}: {time.perf_counter() - t:.2f} s  ({lm.path.name})")
    if lm is not None and args.decode:
        print(
            f"decode batch 1 ({args.dtype}): {decode_speed(lm, args.decode):.1f} tokens/s ({torch.get_num_threads()} threads)"
        )
        if args.batch:
            rate = batch_decode_speed(lm, args.decode, args.batch)
            print(f"decode batch {args.batch} ({args.dtype}): {rate:.1f} tokens/s aggregate")


if __name__ == "__main__":
    main()
