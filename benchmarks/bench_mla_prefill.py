"""Time to the first token of DeepSeek V3 prompts on the packed-float path: chunks on the tiled
absorbed MLA kernel (engine_native/src/kernels/attention_mla_rows.cpp, bit-identical to decode)
against the torch forms (expanded SDPA for chunks of more than ``ABSORB_MAX_QUERY`` rows) as the
peer, interleaved in one process on one engine (prefix caching off), medians over ``--repeats``.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_mla_prefill.py \\
        --model checkpoints/tiny-deepseek-v3 --lengths 128 512 1024

Each repeat times both forms on fresh random prompts of every length, alternating which goes
first; the ratio column is tiled / torch (below 1: the tiled kernel is faster). Only attention
differs between the two, so the ratio also moves with how large a share of the prefill attention is.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch


def ttft(engine: Any, prompt: list[int], name: str) -> float:
    """Seconds from adding one greedy one-token request to its completion."""
    from agent_infer.sampling_params import SamplingParams

    start = time.perf_counter()
    engine.add_request(name, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["AGENT_INFER_NUM_THREADS"] = str(args.threads)

    from agent_infer.engine.config import EngineConfig
    from agent_infer.engine.llm_engine import LLMEngine
    from agent_infer.model.layers.mla import MultiHeadLatentAttention
    from agent_infer.model.loader import load_model

    loaded = load_model(args.model, device=torch.device("cpu"), dtype=torch.float32)
    engine = LLMEngine(config=EngineConfig(enable_prefix_caching=False), loaded=loaded)
    layers = [m for m in engine.runner.model.modules() if isinstance(m, MultiHeadLatentAttention)]
    if not layers or not layers[0].native:
        raise SystemExit(f"{args.model}: not a DeepSeek V3 model on the packed-float kernels")

    def use(tiled: bool) -> None:
        for layer in layers:
            layer.tiled_chunks = tiled

    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    times: dict[tuple[int, bool], list[float]] = {}
    for rep in range(args.repeats + 1):  # the first pass warms up
        for length in args.lengths:
            order = (True, False) if rep % 2 else (False, True)
            for tiled in order:
                use(tiled)
                prompt = torch.randint(2, vocab, (length,), generator=gen).tolist()
                t = ttft(engine, prompt, f"r{rep}-{length}-{tiled}")
                if rep:
                    times.setdefault((length, tiled), []).append(t)
    use(True)
    print(f"threads {args.threads}; median of {args.repeats} interleaved repeats; load {os.getloadavg()}")
    print(f"{'prompt tokens':>14}{'tiled ms':>11}{'torch ms':>11}{'tiled/torch':>13}")
    for length in args.lengths:
        tiled = statistics.median(times[(length, True)]) * 1e3
        torch_ms = statistics.median(times[(length, False)]) * 1e3
        print(f"{length:>14}{tiled:>11.1f}{torch_ms:>11.1f}{tiled / torch_ms:>13.2f}")


if __name__ == "__main__":
    main()
