"""Time to the first token of DeepSeek V3 prompts on the packed-float path: chunks on the tiled
absorbed MLA kernel (engine_native/src/kernels/attention_mla_rows.cpp, bit-identical to decode)
against the torch forms (expanded SDPA for chunks of more than ``ABSORB_MAX_QUERY`` rows) as the
peer, interleaved in one process on one engine (prefix caching off), medians over ``--repeats``.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_mla_prefill.py \\
        --model checkpoints/tiny-deepseek-v3 --lengths 128 512 1024

Each repeat times both forms on fresh random prompts of every length, alternating which goes
first; the ratio column is tiled / torch (below 1: the tiled kernel is faster). Only attention
differs between the two, so the ratio also moves with how large a share of the prefill attention is.

``--v3-widths`` instead times one layer's attention alone at DeepSeek V3's own widths (nope 128,
rope 64, kv_lora 512, v 128; 8 heads, the time scales with them) for a chunk that is the whole
context: the tile kernel against the expanded form as layers/mla.py runs it (``kv_b`` expansion,
then causal SDPA), interleaved, random inputs.
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


V3_WIDTHS = {"heads": 8, "nope": 128, "rope": 64, "lora": 512, "v": 128}


def _tiled(t: dict[str, torch.Tensor]) -> None:
    from agent_infer.model.layers import native_mla

    w, qn, qr = V3_WIDTHS, t["qn"], t["qr"]
    n = int(qn.shape[0])
    out = torch.empty(n, w["heads"] * w["v"])
    rows = native_mla.mla_rows(torch.tensor([[0, n, n]]), torch.arange(n), n, n)
    rows.run(
        qn.data_ptr(), qr.data_ptr(), t["cache"].data_ptr(), t["kv_b"].data_ptr(), out.data_ptr(), w["heads"],
        w["nope"], w["rope"], w["lora"], w["v"], 0.1, 1, qn.stride(0), qn.stride(1), qr.stride(0), qr.stride(1),
    )  # fmt: skip


def _expanded(t: dict[str, torch.Tensor]) -> None:
    import torch.nn.functional as F

    heads, nope, rope, lora = V3_WIDTHS["heads"], V3_WIDTHS["nope"], V3_WIDTHS["rope"], V3_WIDTHS["lora"]
    n = int(t["qn"].shape[0])
    ctx = t["cache"].index_select(0, torch.arange(n))
    kv = F.linear(ctx[:, :lora], t["kv_b"]).view(n, heads, -1)
    k = torch.cat((kv[:, :, :nope], ctx[:, None, lora:].expand(n, heads, rope)), -1).transpose(0, 1)
    q = torch.cat((t["qn"], t["qr"]), -1).transpose(0, 1)
    F.scaled_dot_product_attention(q, k, kv[:, :, nope:].transpose(0, 1), is_causal=True, scale=0.1)


def v3_widths(lengths: list[int], repeats: int) -> None:
    """Print one layer's chunk attention time, tile kernel vs expanded SDPA, at V3's widths."""
    w = V3_WIDTHS
    g = torch.Generator().manual_seed(0)
    print(f"one layer at V3's widths {w}; median of {repeats}; load {os.getloadavg()}")
    print(f"{'chunk tokens':>14}{'tiled ms':>11}{'expanded ms':>13}{'tiled/expanded':>16}")
    for n in lengths:
        t = {
            "cache": torch.randn(n, w["lora"] + w["rope"], generator=g),
            "kv_b": torch.randn(w["heads"] * (w["nope"] + w["v"]), w["lora"], generator=g) * 0.05,
            "qn": torch.randn(n, w["heads"], w["nope"], generator=g),
            "qr": torch.randn(n, w["heads"], w["rope"], generator=g),
        }
        times: dict[str, list[float]] = {"tiled": [], "expanded": []}
        for rep in range(repeats + 1):
            forms = (("tiled", _tiled), ("expanded", _expanded))
            for name, fn in forms if rep % 2 else forms[::-1]:
                start = time.perf_counter()
                fn(t)
                if rep:
                    times[name].append(time.perf_counter() - start)
        tiled, expanded = (statistics.median(times[k]) * 1e3 for k in ("tiled", "expanded"))
        print(f"{n:>14}{tiled:>11.1f}{expanded:>13.1f}{tiled / expanded:>16.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a DeepSeek V3 folder (not needed with --v3-widths)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--v3-widths", action="store_true", help="time one layer's attention at V3's widths")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["AGENT_INFER_NUM_THREADS"] = str(args.threads)
    if args.v3_widths:
        v3_widths(args.lengths, args.repeats)
        return

    from agent_infer.engine.config import EngineConfig
    from agent_infer.engine.llm_engine import LLMEngine
    from agent_infer.model.layers.mla import MultiHeadLatentAttention
    from agent_infer.model.loader import load_model

    if not args.model:
        raise SystemExit("--model is required (or --v3-widths)")
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
