"""Engine throughput and latency: agent-infer vs Hugging Face transformers vs llama-cpp-python.

All engines run the same GGUF (the default SmolLM2-135M-Instruct unless ``--model``, which takes a
path or a packaged model name such as ``gemma3-270m``), or the same Hugging Face folder (``--model
checkpoints/tiny-deepseek-v3``: transformers then loads the weights our loader reads, FP8 blocks
dequantized to float32, and llama-cpp-python, which needs a GGUF, is not run), the same
prompt token ids, greedy decoding with EOS ignored, on the CPU with 2 torch/ggml threads (llama-cpp-python also with 1) and
``OMP_WAIT_POLICY=PASSIVE``. Engines are interleaved within every repeat (so a change in machine
load hits all of them alike) and the table shows medians over ``--repeats`` runs after one warm-up.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_engine.py

Metrics:
* TTFT: prompt submitted → first token available (batch 1).
* decode tok/s (batch 1): tokens after the first / time after the first.
* An extra "agent-infer (bf16)" row (skip with ``--skip bf16``) shows the same engine in bfloat16,
  where oneDNN's avx512_bf16 kernels replace MKL's small-M sgemm; ratios stay against the fp32 row.
* ``--dequantized`` adds an "agent-infer (dequant fp32)" row: the same engine with every tensor
  the native kernels could keep packed only since K-quant support (Q5_0, Q4_K, Q6_K, and fused
  projections mixing 32-value types) dequantized to float32 at load instead, float32 activations
  there. It is the peer that shows what the packed K-quant kernels buy on files such as Gemma 3's.
* N-way tok/s: all generated tokens / wall time from submitting N prompts to the last token.
  transformers runs one left-padded ``generate`` over the N prompts; llama-cpp-python has no
  batched API, so its single-stream decode rate is the comparison point.
* tok/CPU-s: the same runs' tokens per second of process CPU time (all threads), which a shared
  machine's load changes far less than wall time: the batch-1 run (prefill included) and the
  N-way run (not for llama-cpp-python, whose N-way column is its single stream).
* KV bytes per token (Hugging Face folders): what our engine's cache holds per token (all layers,
  in the engine's dtype), against transformers' cache of the same model and a GQA model of the same
  width (layers, hidden size and query heads; ``hidden / heads`` per head and a quarter of the heads
  as K/V heads, the usual 4:1 grouping) and its multi-head (every head K/V) form.
"""

from __future__ import annotations

import os

# Must be set before torch (and its OpenMP runtime) loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

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


class Engine(Protocol):
    """What the benchmark drives: one batch-1 run and one N-way run."""

    name: str
    note: str

    def single(self, prompt: list[int], max_tokens: int) -> tuple[float, float]:
        """Generate ``max_tokens`` tokens; return (TTFT seconds, decode tokens/s)."""
        ...

    def batched(self, prompts: list[list[int]], max_tokens: int) -> float | None:
        """Generate ``max_tokens`` tokens for every prompt concurrently; return aggregate tokens/s."""
        ...


@dataclass
class Samples:
    """Raw measurements of one engine across repeats."""

    ttft: list[float] = field(default_factory=list)
    decode: list[float] = field(default_factory=list)
    aggregate: list[float] = field(default_factory=list)
    #: Tokens per second of process CPU time (all threads): batch-1 run (prefill included), N-way run.
    single_cpu: list[float] = field(default_factory=list)
    aggregate_cpu: list[float] = field(default_factory=list)


def prompt_ids(tokenizer: Any, n: int) -> list[list[int]]:
    """``n`` distinct prompts as chat-formatted token ids of varying length."""
    prompts = []
    for i in range(n):
        text = BASE_PROMPTS[i % len(BASE_PROMPTS)] + (f" (variant {i})" if i >= len(BASE_PROMPTS) else "")
        chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        prompts.append(tokenizer.encode(chat, add_special_tokens=False))
    return prompts


class Ours:
    """agent-infer's LLMEngine on weights dequantized from the GGUF (float32, or bfloat16 for the extra row)."""

    note = ""

    def __init__(
        self, loaded: Any, dtype: str = "float32", name: str | None = None, speculative: int | None = None
    ) -> None:
        from agent_infer.engine.config import EngineConfig
        from agent_infer.engine.llm_engine import LLMEngine

        self.name = name or ("agent-infer (fp32)" if dtype == "float32" else "agent-infer (bf16)")
        if dtype != "float32":
            self.note = "same engine, bf16 weights/activations/KV: not precision-matched with the fp32 rows"
        # Prefix caching off: every repeat must pay the full prefill, like the other engines.
        extra = {} if speculative is None else {"speculative_tokens": speculative}
        config = EngineConfig(enable_prefix_caching=False, dtype=dtype, **extra)
        if speculative is not None:
            self.note = f"speculative_tokens={speculative}"
        self.engine = LLMEngine(config=config, loaded=loaded)
        self.ids = iter(range(10**9))

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

    def batched(self, prompts: list[list[int]], max_tokens: int) -> float | None:
        start = time.perf_counter()
        for p in prompts:
            self.engine.add_request(f"r{next(self.ids)}", p, self._params(max_tokens))
        while self.engine.has_unfinished_requests():
            self.engine.step()
        return len(prompts) * max_tokens / (time.perf_counter() - start)


def hf_folder_model(folder: Path) -> Any:
    """transformers' model of an HF folder on the weights our loader reads (FP8 blocks dequantized),
    float32; tensors transformers does not instantiate (DeepSeek's MTP layer) are left out."""
    import json
    import tempfile

    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from agent_infer.model.loading.hf import hf_weights

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config.pop("quantization_config", None)
    mtp = tuple(
        f"model.layers.{config['num_hidden_layers'] + i}."
        for i in range(int(config.get("num_nextn_predict_layers") or 0))
    )
    tensors = {name: t.contiguous() for name, t in hf_weights(folder) if not name.startswith(mtp)}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        hf_config = AutoConfig.from_pretrained(tmp)
        model = AutoModelForCausalLM.from_pretrained(tmp, config=hf_config, dtype=torch.float32)
    return model


def load_dequantized(model: str | None) -> Any:
    """Load ``model`` with only the types packed before K-quant kernels kept packed (the rest float32)."""
    from agent_infer.model.loader import load_model
    from agent_infer.model.loading import gguf as gguf_loading

    saved = gguf_loading.NATIVE_TYPES, gguf_loading.Q8_COMPATIBLE
    # F32, F16, Q4_0, Q4_1, Q8_0, BF16; mixed fused projections widen to float32
    gguf_loading.NATIVE_TYPES, gguf_loading.Q8_COMPATIBLE = frozenset({0, 1, 2, 3, 8, 30}), frozenset()
    try:
        return load_model(model)
    finally:
        gguf_loading.NATIVE_TYPES, gguf_loading.Q8_COMPATIBLE = saved


class Transformers:
    """Hugging Face transformers ``generate`` (float32, dequantized from the same GGUF or folder)."""

    name = "transformers (fp32)"
    note = "N-way = one left-padded batched generate"

    def __init__(self, source: Path) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.generation.streamers import BaseStreamer

        if source.is_dir():
            self.model = hf_folder_model(source)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                str(source.parent), gguf_file=source.name, dtype=torch.float32
            )
        self.model.eval()
        eos = self.model.generation_config.eos_token_id
        self.pad = eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)

        class Clock(BaseStreamer):  # type: ignore[misc]
            """Records when generate hands out each new token (the first put() is the prompt)."""

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
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.pad,
                streamer=streamer,
            )

    def single(self, prompt: list[int], max_tokens: int) -> tuple[float, float]:
        clock = self.clock_type()
        start = time.perf_counter()
        self._generate([prompt], max_tokens, clock)
        end = time.perf_counter()
        first = clock.times[1]  # times[0] is generate echoing the prompt
        return first - start, (max_tokens - 1) / (end - first)

    def batched(self, prompts: list[list[int]], max_tokens: int) -> float | None:
        start = time.perf_counter()
        self._generate(prompts, max_tokens)
        return len(prompts) * max_tokens / (time.perf_counter() - start)


class LlamaCpp:
    """llama-cpp-python on the GGUF as stored (its quantized weights, llama.cpp's own kernels)."""

    name = "llama-cpp-python"
    note = "no batched API: N-way column = its single-stream decode rate"

    def __init__(self, gguf: Path, threads: int = THREADS) -> None:
        from llama_cpp import Llama

        # On a small CPU one ggml thread can beat two (no barrier per op): both rows are shown.
        if threads != THREADS:
            self.name = f"llama-cpp-python ({threads} thread{'s' if threads > 1 else ''})"
        self.llm = Llama(
            model_path=str(gguf), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False
        )
        self.last_decode: float | None = None

    def single(self, prompt: list[int], max_tokens: int) -> tuple[float, float]:
        self.llm.reset()  # forget the previous prompt so each run pays its prefill
        start = time.perf_counter()
        first = None
        for count, _token in enumerate(self.llm.generate(prompt, temp=0.0, reset=True), start=1):
            if first is None:
                first = time.perf_counter()
            if count == max_tokens:
                break
        end = time.perf_counter()
        assert first is not None
        self.last_decode = (max_tokens - 1) / (end - first)
        return first - start, self.last_decode

    def batched(self, prompts: list[list[int]], max_tokens: int) -> float | None:
        return self.last_decode


def kv_bytes_table(
    loaded: Any, dtype: torch.dtype = torch.float32, block_size: int | None = None
) -> list[str]:
    """Lines comparing KV-cache bytes per token: our engine's cache (at the engine's block size: the
    compressed layout's share of an entry depends on it), transformers' cache of the same model
    (DeepSeek V3: MLA expanded to per-head K and V), and a same-width 4:1 GQA model."""
    from agent_infer.engine.config import EngineConfig
    from agent_infer.model.kv_cache import KVCache

    c = loaded.config
    size = torch.finfo(dtype).bits // 8
    ours = KVCache.bytes_per_token(c, block_size or EngineConfig().block_size, dtype)
    heads = c.num_heads
    gqa = 2 * c.num_layers * max(1, heads // 4) * (c.hidden_size // heads) * size
    rows = [("agent-infer cache", ours)]
    if c.mla is not None:
        m = c.mla
        expanded = c.num_layers * heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * size
        rows.append(("transformers cache (expanded K, V)", expanded))
    rows.append((f"GQA, {c.num_layers} layers, {max(1, heads // 4)} of {heads} heads as K/V", gqa))
    rows.append((f"MHA, {c.num_layers} layers, {heads} K/V heads", gqa * heads // max(1, heads // 4)))
    lines = [f"{'KV cache (' + str(dtype).removeprefix('torch.') + ')':<52}{'bytes/token':>12}{'vs ours':>9}"]
    lines += [f"{name:<52}{value:>12,.1f}{value / ours:>8.2f}x" for name, value in rows]
    return lines


def fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def ratio(ours: float | None, other: float | None, lower_is_better: bool = False) -> str:
    if not ours or not other:
        return "-"
    return f"{(other / ours) if lower_is_better else (ours / other):.2f}x"


def med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def measure(
    engines: list[Engine], prompts: list[list[int]], max_tokens: int, repeats: int
) -> dict[str, Samples]:
    """Batch 1 (the first prompt), then all ``prompts`` at once, per engine, interleaved in every
    repeat; repeat 0 warms caches and allocators and is discarded. Progress goes to stderr."""
    samples = {e.name: Samples() for e in engines}
    for rep in range(repeats + 1):
        for e in engines:
            cpu0 = time.process_time()
            ttft, decode = e.single(prompts[0], max_tokens)
            cpu1 = time.process_time()
            aggregate = e.batched(prompts, max_tokens)
            cpu2 = time.process_time()
            if rep:
                s = samples[e.name]
                s.ttft.append(ttft)
                s.decode.append(decode)
                s.single_cpu.append(max_tokens / max(cpu1 - cpu0, 1e-9))
                if aggregate is not None:
                    s.aggregate.append(aggregate)
                    if not isinstance(e, LlamaCpp):
                        s.aggregate_cpu.append(len(prompts) * max_tokens / max(cpu2 - cpu1, 1e-9))
            print(
                f"  rep {rep} {e.name}: ttft {ttft * 1000:.0f} ms, decode {decode:.1f} tok/s, "
                f"{len(prompts)}-way {fmt(aggregate, '.1f')} tok/s",
                file=sys.stderr,
            )
    return samples


def print_table(engines: list[Engine], samples: dict[str, Samples], concurrency: int) -> None:
    """The medians of every engine and their ratios against the first engine, then the engines' notes."""
    agg_col = f"{concurrency}-way tok/s"
    header = f"{'engine':<28}{'TTFT ms':>9}{'decode tok/s':>14}{agg_col:>15}"
    header += f"{'TTFT ratio':>12}{'decode ratio':>14}{'N-way ratio':>13}"
    print(header)
    print("-" * len(header))
    ours = samples[engines[0].name]
    for e in engines:
        s = samples[e.name]
        ttft = med(s.ttft)
        print(
            f"{e.name:<28}{fmt(ttft and ttft * 1000, '9.1f')}{fmt(med(s.decode), '14.1f')}"
            f"{fmt(med(s.aggregate), '15.1f')}{ratio(med(ours.ttft), ttft, True):>12}"
            f"{ratio(med(ours.decode), med(s.decode)):>14}{ratio(med(ours.aggregate), med(s.aggregate)):>13}"
        )
    print("\nper CPU-second (process time, all threads; the same runs): tokens / CPU s")
    cpu_header = f"{'engine':<28}{'batch-1 tok/CPU-s':>19}{agg_col.replace('tok/s', 'tok/CPU-s'):>19}"
    cpu_header += f"{'batch-1 ratio':>15}{'N-way ratio':>13}"
    print(cpu_header)
    print("-" * len(cpu_header))
    for e in engines:
        s = samples[e.name]
        print(
            f"{e.name:<28}{fmt(med(s.single_cpu), '19.1f')}{fmt(med(s.aggregate_cpu), '19.1f')}"
            f"{ratio(med(ours.single_cpu), med(s.single_cpu)):>15}"
            f"{ratio(med(ours.aggregate_cpu), med(s.aggregate_cpu)):>13}"
        )
    print("\nratios: agent-infer relative to the row's engine (>1 = agent-infer better).")
    for e in engines:
        if e.note:
            print(f"  {e.name}: {e.note}")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="GGUF file or packaged model name (default: smollm2-135m)"
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip", action="append", default=[], choices=["transformers", "llama_cpp", "bf16"])
    parser.add_argument(
        "--dequantized",
        action="store_true",
        help="add a row with Q5_0/Q4_K/Q6_K tensors dequantized to float32 at load (the pre-K-quant-kernel path)",
    )
    parser.add_argument(
        "--speculative-tokens",
        type=int,
        action="append",
        default=[],
        help="add an agent-infer (fp32) row with this speculative_tokens (0: speculation off); repeatable",
    )
    args = parser.parse_args(argv)

    torch.set_num_threads(THREADS)
    os.environ["AGENT_INFER_NUM_THREADS"] = str(THREADS)
    from agent_infer.model.loader import load_model

    loaded = load_model(args.model)
    gguf = Path(loaded.path)
    folder = gguf.is_dir()
    if gguf.suffix != ".gguf" and not folder:
        print(f"model {gguf} is neither a GGUF file nor a Hugging Face folder", file=sys.stderr)
        return 2
    prompts = prompt_ids(loaded.tokenizer, args.concurrency)

    engines: list[Engine] = [Ours(loaded)]
    for spec in args.speculative_tokens:
        engines.append(Ours(loaded, name=f"agent-infer (fp32, spec {spec})", speculative=spec))
    if args.dequantized:
        engines.append(Ours(load_dequantized(args.model), name="agent-infer (dequant fp32)"))
    if "bf16" not in args.skip:
        engines.append(Ours(load_model(args.model, dtype=torch.bfloat16), dtype="bfloat16"))
    missing: list[str] = []
    for key, factory in (("transformers", Transformers), ("llama_cpp", LlamaCpp)):
        if key in args.skip:
            continue
        if key == "llama_cpp" and folder:
            missing.append("llama_cpp: a Hugging Face folder has no GGUF for it")
            continue
        try:
            engines.append(factory(gguf))
            if key == "llama_cpp" and THREADS > 1:
                engines.append(LlamaCpp(gguf, threads=1))
        except Exception as exc:  # a peer that cannot load is reported, not fatal
            missing.append(f"{key}: {type(exc).__name__}: {exc}")

    samples = measure(engines, prompts, args.max_tokens, args.repeats)
    print(
        f"\nmodel {gguf.name}; batch-1 prompt {len(prompts[0])} tokens; {args.max_tokens} new tokens; greedy, "
        f"EOS ignored; {args.concurrency} concurrent prompts of {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens; medians of {args.repeats}, engines interleaved; "
        f"torch/ggml threads={THREADS}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}; "
        f"torch {torch.__version__}\n"
    )
    print_table(engines, samples, args.concurrency)
    for line in missing:
        print(f"  not run: {line}")
    if folder:
        print()
        print("\n".join(kv_bytes_table(loaded)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
