"""Mask-apply kernels side by side: median µs per call for each backend, batch and vocabulary.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_mask_kernels.py            # CPU: cpu vs torch
    python3 benchmarks/bench_mask_kernels.py --device cuda --out bench_results/masks.json  # triton vs cuda vs torch

Every backend masks the same float32 logits with the same sparse bitmask (about 1 % of tokens
allowed, the typical constrained step: nearly every logit is written). Two clocks per case:

* ``call``: :func:`apply_token_bitmask_inplace` with the backend forced through
  ``AGENT_INFER_MASK_BACKEND`` (argument checks + dispatch + kernel), what the engine pays;
* ``kernel``: the backend's ``apply`` on already-normalised tensors (launch + kernel only).

Each sample is ``--calls`` back-to-back calls between two device synchronisations, divided by the
call count; the table shows the median of ``--repeats`` samples after a warm-up (which also
compiles Triton/CUDA kernels). ``indices`` rows mask every other row through an index tensor.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agent_infer.grammar.runtime.bitmask import (
    apply_token_bitmask_inplace,
    bitmask_words,
    normalise_arguments,
)
from agent_infer.grammar.runtime.kernels import available, backend_module


def sparse_mask(rows: int, vocab: int, density: float, seed: int) -> torch.Tensor:
    """An int32 bitmask allowing about ``density`` of the tokens, at random."""
    g = torch.Generator().manual_seed(seed)
    allowed = torch.rand((rows, bitmask_words(vocab) * 32), generator=g) < density
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64)
    words = (allowed.view(rows, -1, 32).to(torch.int64) * weights).sum(-1)
    return words.to(torch.int32)  # wraps bit 31 into the sign, as the grammar side writes it


def time_calls(fn: Callable[[], None], sync: Callable[[], None], calls: int, repeats: int) -> float:
    """Median µs per call over ``repeats`` samples of ``calls`` back-to-back calls."""
    for _ in range(3):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def run(
    device: str, backends: list[str], batches: list[int], vocabs: list[int], args: Any
) -> list[dict[str, Any]]:
    """One record per (backend, vocab, batch, indices?)."""
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    records = []
    for vocab in vocabs:
        for batch in batches:
            logits = torch.randn(batch, vocab, device=dev, dtype=getattr(torch, args.dtype))
            mask = sparse_mask(batch, vocab, args.density, seed=vocab + batch).to(dev)
            for with_indices in (False, True):
                idx = torch.arange(0, batch, 2, device=dev) if with_indices else None
                for name in backends:
                    if not available(name, dev):
                        print(f"  skip {name}: not available on {device}", file=sys.stderr)
                        continue
                    module = backend_module(name)
                    view, m, i = normalise_arguments(logits, mask, idx)
                    if not module.supports(view):
                        print(f"  skip {name}: does not support {args.dtype}", file=sys.stderr)
                        continue
                    os.environ["AGENT_INFER_MASK_BACKEND"] = name

                    def call(view: torch.Tensor = view, m: torch.Tensor = m, i: Any = idx) -> None:
                        apply_token_bitmask_inplace(view, m, i)

                    def kernel(
                        view: torch.Tensor = view, m: torch.Tensor = m, i: Any = i, module: Any = module
                    ) -> None:
                        module.apply(view, m, i)

                    try:
                        call_us = time_calls(call, sync, args.calls, args.repeats)
                        kernel_us = time_calls(kernel, sync, args.calls, args.repeats)
                    except Exception as exc:  # a backend that fails is reported, the others still run
                        print(f"  {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                        records.append(
                            {"backend": name, "vocab": vocab, "batch": batch, "indices": with_indices,
                             "error": f"{type(exc).__name__}: {exc}"}
                        )  # fmt: skip
                        continue
                    finally:
                        os.environ.pop("AGENT_INFER_MASK_BACKEND", None)
                    rec = {
                        "backend": name, "vocab": vocab, "batch": batch, "indices": with_indices,
                        "call_us": round(call_us, 2), "kernel_us": round(kernel_us, 2),
                    }  # fmt: skip
                    records.append(rec)
                    print(f"  {rec}", file=sys.stderr)
    return records


def table(records: list[dict[str, Any]], backends: list[str]) -> str:
    """Markdown: one row per case, call/kernel µs per backend, and each backend relative to torch."""
    present = [b for b in backends if any(r["backend"] == b and "call_us" in r for r in records)]
    head = "| vocab | batch | rows masked | " + " | ".join(f"{b} call / kernel µs" for b in present)
    head += " | " + " | ".join(f"torch / {b} (call)" for b in present if b != "torch") + " |"
    lines = [head, "|" + "---|" * (3 + len(present) + len([b for b in present if b != "torch"]))]
    cases = sorted({(r["vocab"], r["batch"], r["indices"]) for r in records})
    for vocab, batch, with_indices in cases:
        by = {
            r["backend"]: r
            for r in records
            if (r["vocab"], r["batch"], r["indices"]) == (vocab, batch, with_indices)
        }
        masked = f"{(batch + 1) // 2} (indices)" if with_indices else str(batch)
        cells = []
        for b in present:
            r = by.get(b, {})
            cells.append(f"{r['call_us']:.1f} / {r['kernel_us']:.1f}" if "call_us" in r else "-")
        ratios = []
        for b in present:
            if b == "torch":
                continue
            t, r = by.get("torch", {}), by.get(b, {})
            ratios.append(f"{t['call_us'] / r['call_us']:.1f}x" if "call_us" in t and "call_us" in r else "-")
        lines.append(f"| {vocab} | {batch} | {masked} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the markdown table, optionally save JSON."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument(
        "--backends", default=None, help="comma list (default: cpu,torch on CPU; triton,cuda,torch on CUDA)"
    )
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--vocabs", default="49152,129280")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--density", type=float, default=0.01, help="fraction of allowed tokens")
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None, help="JSON file for the raw records")
    args = parser.parse_args(argv)
    default = "cpu,torch" if args.device == "cpu" else "triton,cuda,torch"
    backends = (args.backends or default).split(",")
    batches = [int(b) for b in args.batches.split(",")]
    vocabs = [int(v) for v in args.vocabs.split(",")]
    records = run(args.device, backends, batches, vocabs, args)
    info = {
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "dtype": args.dtype,
        "density": args.density,
        "calls": args.calls,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
    }
    md = table(records, backends)
    print(
        f"mask kernels on {info['device']} ({args.dtype} logits, ~{args.density:.0%} allowed); median µs per call\n"
    )
    print(md)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"info": info, "records": records, "table": md}, indent=1))
    return 0 if all("error" not in r for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
