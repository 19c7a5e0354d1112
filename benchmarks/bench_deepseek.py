"""DeepSeek decode speed and cache size: agent-infer vs transformers on the same HF folder.

Both engines load the same DeepSeek folder (``--model``; by default the tiny random 5-layer
``DeepseekV4ForCausalLM`` checkpoint of the tests, written to a temporary folder; an FP8 checkpoint
such as ``checkpoints/tiny-deepseek-v3`` reaches transformers dequantized, as bench_engine.py does
it) in float32 on the CPU with ``--threads`` torch threads and ``OMP_WAIT_POLICY=PASSIVE``, get the
same prompt token ids, and decode greedily with EOS ignored. Engines alternate within every repeat
(a change in machine load hits both alike); the table shows medians over ``--repeats`` after one
warm-up. ``--speculative-tokens N`` adds an agent-infer row with that setting (0: speculation off).

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_deepseek.py

Metrics:
* TTFT: prompt submitted -> first token (batch 1).
* decode tok/s (batch 1): tokens after the first / time after the first.
* N-way tok/s: every generated token / wall time from submitting N prompts to the last token
  (ours: N requests through ``LLMEngine.step``; transformers: one left-padded batched ``generate``).
* tok/CPU-s: the same runs' tokens per second of process CPU time (all threads); the batch-1 run's
  includes its prefill.
* KV bytes/token: ours as ``ModelRunner.kv_bytes_per_token`` reports it (the compressed layout at
  the engine's block size), next to a GQA layout of the same width (``2 * heads * head_dim`` per
  layer, one KV head per 4 query heads) for scale.
"""

from __future__ import annotations

import os

# Must be set before torch (and its OpenMP runtime) loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(2, vocab, (length + i % 5,), generator=gen).tolist() for i in range(n)]


class Ours:
    """agent-infer's LLMEngine on the folder (prefix caching off: every repeat pays its prefill)."""

    name = "agent-infer (fp32)"

    def __init__(self, folder: Path, speculative: int | None = None) -> None:
        from agent_infer.engine.config import EngineConfig
        from agent_infer.engine.llm_engine import LLMEngine
        from agent_infer.model.loader import load_model

        loaded = load_model(str(folder), device=torch.device("cpu"), dtype=torch.float32)
        extra = {} if speculative is None else {"speculative_tokens": speculative}
        if speculative is not None:
            self.name = f"agent-infer (fp32, spec {speculative})"
        self.engine = LLMEngine(config=EngineConfig(enable_prefix_caching=False, **extra), loaded=loaded)
        self.ids = iter(range(10**9))

    def kv_bytes_per_token(self) -> float:
        return float(self.engine.runner.kv_bytes_per_token)

    def _params(self, max_tokens: int) -> Any:
        from agent_infer.sampling_params import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def single(self, prompt: list[int], max_tokens: int) -> tuple[float, float]:
        start = time.perf_counter()
        self.engine.add_request(f"r{next(self.ids)}", prompt, self._params(max_tokens))
        first = None
        while self.engine.has_unfinished_requests():
            self.engine.step()
            if first is None:
                first = time.perf_counter()
        end = time.perf_counter()
        assert first is not None
        return first - start, (max_tokens - 1) / (end - first)

    def batched(self, prompts: list[list[int]], max_tokens: int) -> float:
        start = time.perf_counter()
        for p in prompts:
            self.engine.add_request(f"r{next(self.ids)}", p, self._params(max_tokens))
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return len(prompts) * max_tokens / (time.perf_counter() - start)


class Transformers:
    """transformers' ``DeepseekV4ForCausalLM.generate`` (float32, its own cache)."""

    name = "transformers (fp32)"

    def __init__(self, folder: Path) -> None:
        import json

        import transformers
        from transformers.generation.streamers import BaseStreamer

        if "quantization_config" in json.loads((folder / "config.json").read_text()):
            # An FP8 checkpoint: transformers gets the weights our loader reads, dequantized.
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from bench_engine import hf_folder_model

            self.model = hf_folder_model(folder).eval()
        else:
            self.model = transformers.DeepseekV4ForCausalLM.from_pretrained(
                str(folder), dtype=torch.float32
            ).eval()
        self.pad = 0

        class Clock(BaseStreamer):  # type: ignore[misc]
            """When generate hands out each token (the first put() is the prompt)."""

            def __init__(self) -> None:
                self.times: list[float] = []

            def put(self, value: Any) -> None:
                self.times.append(time.perf_counter())

            def end(self) -> None:
                pass

        self.clock_type = Clock

    def _generate(self, prompts: list[list[int]], max_tokens: int, streamer: Any = None) -> None:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            self.model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                do_sample=False, pad_token_id=self.pad, streamer=streamer,
            )  # fmt: skip

    def single(self, prompt: list[int], max_tokens: int) -> tuple[float, float]:
        clock = self.clock_type()
        start = time.perf_counter()
        self._generate([prompt], max_tokens, clock)
        end = time.perf_counter()
        first = clock.times[1]
        return first - start, (max_tokens - 1) / (end - first)

    def batched(self, prompts: list[list[int]], max_tokens: int) -> float:
        start = time.perf_counter()
        self._generate(prompts, max_tokens)
        return len(prompts) * max_tokens / (time.perf_counter() - start)


def _gqa_bytes_per_token(folder: Path) -> float:
    import json

    c = json.loads((folder / "config.json").read_text())
    kv_heads = max(1, int(c["num_attention_heads"]) // 4)
    return 2.0 * kv_heads * int(c["head_dim"]) * int(c["num_hidden_layers"]) * 4


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="DeepseekV4ForCausalLM folder (default: tiny random one)")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--skip", choices=["transformers"], action="append", default=[])
    ap.add_argument(
        "--speculative-tokens",
        type=int,
        action="append",
        default=[],
        help="add an agent-infer row with this speculative_tokens (0: speculation off); repeatable",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = None
    folder = args.model
    if folder is None:
        sys.path.insert(0, str(ROOT / "tests" / "support"))
        from deepseek_support import write_tokenizer
        from deepseek_v4_support import save_tiny

        tmp = tempfile.TemporaryDirectory()
        folder = Path(tmp.name)
        save_tiny(folder, vocab_size=49152)
        write_tokenizer(folder)
    import json

    vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
    engines: list[Any] = [Ours(folder)] + [Ours(folder, spec) for spec in args.speculative_tokens]
    if "transformers" not in args.skip:
        engines.append(Transformers(folder))
    single = _prompts(1, args.prompt_len, vocab)[0]
    many = _prompts(args.concurrency, args.prompt_len, vocab)
    keys = ("ttft", "dec", "agg", "dec_cpu", "agg_cpu")
    samples: dict[str, dict[str, list[float]]] = {e.name: {k: [] for k in keys} for e in engines}
    for rep in range(args.repeats + 1):
        for e in engines:
            cpu0 = time.process_time()
            ttft, dec = e.single(single, args.max_tokens)
            cpu1 = time.process_time()
            agg = e.batched(many, args.max_tokens)
            cpu2 = time.process_time()
            if rep:  # the first round warms up
                samples[e.name]["ttft"].append(ttft)
                samples[e.name]["dec"].append(dec)
                samples[e.name]["agg"].append(agg)
                samples[e.name]["dec_cpu"].append(args.max_tokens / max(cpu1 - cpu0, 1e-9))
                samples[e.name]["agg_cpu"].append(len(many) * args.max_tokens / max(cpu2 - cpu1, 1e-9))
    med = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    peer = med.get(Transformers.name)
    print(
        f"model: {args.model or 'tiny random V4 (5 layers, hidden 64)'}; prompt {args.prompt_len} tokens, "
        f"{args.max_tokens} generated, {args.threads} thread(s), median of {args.repeats}"
    )
    print(
        f"| engine | TTFT ms | decode tok/s (batch 1) | {args.concurrency}-way tok/s | vs transformers (1 / N) "
        f"| batch-1 tok/CPU-s | {args.concurrency}-way tok/CPU-s | CPU vs transformers (1 / N) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, m in med.items():
        ratio = f"{m['dec'] / peer['dec']:.2f}x / {m['agg'] / peer['agg']:.2f}x" if peer else "-"
        cpu = (
            f"{m['dec_cpu'] / peer['dec_cpu']:.2f}x / {m['agg_cpu'] / peer['agg_cpu']:.2f}x" if peer else "-"
        )
        print(
            f"| {name} | {m['ttft'] * 1e3:.1f} | {m['dec']:.1f} | {m['agg']:.1f} | {ratio} "
            f"| {m['dec_cpu']:.1f} | {m['agg_cpu']:.1f} | {cpu} |"
        )
    print(
        "tok/CPU-s: tokens per second of process CPU time (all threads) of the same runs; the batch-1 "
        "run's includes its prefill."
    )
    print(
        f"KV bytes/token (fp32): ours {engines[0].kv_bytes_per_token():.1f}; "
        f"GQA of the same width (heads/4 KV heads): {_gqa_bytes_per_token(folder):.1f}"
    )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
