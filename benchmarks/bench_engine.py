"""Engine throughput and latency: agent-infer vs Hugging Face transformers vs llama-cpp-python.

All engines run the same GGUF (the default SmolLM2-135M-Instruct unless ``--model``), the same
prompt token ids, greedy decoding with EOS ignored, on the CPU with 2 torch/ggml threads and
``OMP_WAIT_POLICY=PASSIVE``. Reported numbers are medians over ``--repeats`` runs.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_engine.py

Metrics:
* TTFT: prompt submitted → first token available (batch 1).
* decode tok/s (batch 1): tokens after the first / time after the first.
* aggregate tok/s (N concurrent): all generated tokens / wall time from submission to the last token.
  transformers runs one padded ``generate`` over the N prompts; llama-cpp-python has no batched
  API, so its single-stream decode rate is the comparison point.
"""

from __future__ import annotations

import os

# Must be set before torch (and its OpenMP runtime) loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

THREADS = 2
BASE_PROMPTS = [
    "Explain, step by step, how a bicycle stays upright while moving.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List the planets of the solar system and one fact about each.",
    "What are the main differences between Python lists and tuples?",
    "Describe the water cycle to a ten-year-old.",
    "Give three tips for writing clear technical documentation.",
    "Summarise the plot of a heist movie in five sentences.",
    "How does a hash table handle collisions?",
]


@dataclass
class Result:
    """One engine's medians (None where not measured)."""

    name: str
    ttft_s: float | None = None
    decode_tps: float | None = None
    aggregate_tps: float | None = None
    note: str = ""


def median(fn: Callable[[], float], repeats: int) -> float:
    """Median of ``repeats`` calls after one warm-up call."""
    fn()
    return statistics.median(fn() for _ in range(repeats))


def prompt_ids(tokenizer: Any, n: int) -> list[list[int]]:
    """``n`` distinct prompts as chat-formatted token ids of varying length."""
    prompts = []
    for i in range(n):
        text = BASE_PROMPTS[i % len(BASE_PROMPTS)] + (f" (variant {i})" if i >= len(BASE_PROMPTS) else "")
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(tokenizer.encode(chat, add_special_tokens=False))
    return prompts


# --- agent-infer ---------------------------------------------------------------------------------


def bench_ours(loaded: Any, prompts: list[list[int]], max_tokens: int, repeats: int) -> Result:
    from agent_infer.engine.config import EngineConfig
    from agent_infer.engine.llm_engine import LLMEngine
    from agent_infer.sampling_params import SamplingParams

    # Prefix caching off: every repeat must pay the full prefill like the other engines do.
    engine = LLMEngine(config=EngineConfig(enable_prefix_caching=False), loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    counter = iter(range(10**9))

    def single() -> tuple[float, float]:
        start = time.perf_counter()
        engine.add_request(f"b1-{next(counter)}", prompts[0], params)
        first = None
        while engine.has_unfinished_requests():
            engine.step()
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        assert first is not None
        return first - start, (max_tokens - 1) / (end - first)

    single()
    runs = [single() for _ in range(repeats)]

    def batched() -> float:
        start = time.perf_counter()
        for p in prompts:
            engine.add_request(f"bn-{next(counter)}", p, params)
        while engine.has_unfinished_requests():
            engine.step()
        return len(prompts) * max_tokens / (time.perf_counter() - start)

    return Result(
        "agent-infer (fp32)",
        ttft_s=statistics.median(r[0] for r in runs),
        decode_tps=statistics.median(r[1] for r in runs),
        aggregate_tps=median(batched, repeats),
    )


# --- transformers ----------------------------------------------------------------------------------


def bench_transformers(gguf: Path, prompts: list[list[int]], max_tokens: int, repeats: int) -> Result:
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        return Result("transformers (fp32)", note=f"not importable: {exc}")
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.eval()
    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)

    def run(batch: list[list[int]], new_tokens: int) -> float:
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        return time.perf_counter() - start

    ttft = median(lambda: run(prompts[:1], 1), repeats)
    total = median(lambda: run(prompts[:1], max_tokens), repeats)
    aggregate = median(lambda: len(prompts) * max_tokens / run(prompts, max_tokens), repeats)
    return Result(
        "transformers (fp32)",
        ttft_s=ttft,
        decode_tps=(max_tokens - 1) / (total - ttft),
        aggregate_tps=aggregate,
        note="decode = (T(n) - T(1)) / (n - 1); aggregate = padded batched generate",
    )


# --- llama.cpp -------------------------------------------------------------------------------------


def bench_llama_cpp(gguf: Path, prompts: list[list[int]], max_tokens: int, repeats: int) -> Result:
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        return Result("llama-cpp-python", note=f"not importable: {exc}")
    llm = Llama(
        model_path=str(gguf),
        n_ctx=2048,
        n_threads=THREADS,
        n_threads_batch=THREADS,
        verbose=False,
    )

    def single() -> tuple[float, float]:
        llm.reset()  # drop its KV prefix reuse so each run pays the prefill
        start = time.perf_counter()
        first = None
        for count, _token in enumerate(llm.generate(prompts[0], temp=0.0, reset=True), start=1):
            if first is None:
                first = time.perf_counter()
            if count == max_tokens:
                break
        end = time.perf_counter()
        assert first is not None
        return first - start, (max_tokens - 1) / (end - first)

    single()
    runs = [single() for _ in range(repeats)]
    decode = statistics.median(r[1] for r in runs)
    return Result(
        "llama-cpp-python (Q4_1 native)",
        ttft_s=statistics.median(r[0] for r in runs),
        decode_tps=decode,
        aggregate_tps=decode,
        note="no batched API: aggregate = single-stream decode rate",
    )


# --- report ----------------------------------------------------------------------------------------


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def ratio(ours: float | None, other: float | None, lower_is_better: bool = False) -> str:
    if ours is None or other is None or ours == 0 or other == 0:
        return "-"
    return f"{(other / ours) if lower_is_better else (ours / other):.2f}x"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="GGUF file (default: the bundled SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", action="append", default=[], choices=["transformers", "llama_cpp"])
    args = parser.parse_args(argv)

    torch.set_num_threads(THREADS)
    os.environ["AGENT_INFER_NUM_THREADS"] = str(THREADS)
    from agent_infer.model.loader import load_model

    loaded = load_model(args.model)
    gguf = Path(loaded.path)
    if gguf.suffix != ".gguf":
        print(f"model source {gguf} is not a GGUF file; peers need one", file=sys.stderr)
        return 2
    prompts = prompt_ids(loaded.tokenizer, args.concurrency)
    results = [bench_ours(loaded, prompts, args.max_tokens, args.repeats)]
    print(f"agent-infer done: {results[0]}", file=sys.stderr)
    peers = {"transformers": bench_transformers, "llama_cpp": bench_llama_cpp}
    for name, bench in peers.items():
        if name in args.skip:
            continue
        try:
            results.append(bench(gguf, prompts, args.max_tokens, args.repeats))
        except Exception as exc:  # a broken peer should not hide the other numbers
            results.append(Result(name, note=f"failed: {type(exc).__name__}: {exc}"))
        print(f"{name} done: {results[-1]}", file=sys.stderr)

    ours = results[0]
    print(
        f"\nmodel {gguf.name}; prompt {len(prompts[0])} tokens (batch 1), {args.max_tokens} new tokens, "
        f"greedy, EOS ignored; {args.concurrency} concurrent; medians of {args.repeats}; "
        f"torch/ggml threads={THREADS}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; torch {torch.__version__}\n"
    )
    header = f"{'engine':<32}{'TTFT ms':>9}{'decode tok/s':>14}{f'{args.concurrency}-way tok/s':>15}"
    header += f"{'TTFT ratio':>12}{'decode ratio':>14}{'agg ratio':>11}"
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r.name:<32}{fmt(r.ttft_s and r.ttft_s * 1000, '9.1f')}{fmt(r.decode_tps, '14.1f')}"
            f"{fmt(r.aggregate_tps, '15.1f')}{ratio(ours.ttft_s, r.ttft_s, True):>12}"
            f"{ratio(ours.decode_tps, r.decode_tps):>14}{ratio(ours.aggregate_tps, r.aggregate_tps):>11}"
        )
    print("\nratios are agent-infer relative to the row's engine (>1 = agent-infer faster).")
    for r in results:
        if r.note:
            print(f"  {r.name}: {r.note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
