"""Dequantization throughput per GGUF type: ours (torch) vs the ``gguf`` package's numpy reference.

Run: ``OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_dequant.py [--mb 16] [--reps 5] [--threads 1]``.

For each type, ``--mb`` megabytes of random blocks (finite fp16/f32 scales), in rows of ``--row`` values
like a weight matrix (gguf's reference works in groups of 16 rows), are dequantized by
:data:`agent_infer.model.loading.gguf_reader._DEQUANT` (the path ``GGUFFile.dequantize`` takes) and by
``gguf.quants.dequantize`` in the same run. Throughput is quantized input bytes per second, median of
``--reps`` timed runs after one warm-up; every run's output is checked bit-exact against the reference.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import gguf
import numpy as np
import torch

from agent_infer.model.loading.gguf_reader import _DEQUANT

QT = gguf.GGMLQuantizationType
TYPES = [
    QT.Q4_0,
    QT.Q8_0,
    QT.Q5_0,
    QT.Q5_1,
    QT.Q2_K,
    QT.Q3_K,
    QT.Q4_K,
    QT.Q5_K,
    QT.Q6_K,
    QT.Q8_K,
    QT.IQ4_NL,
    QT.IQ4_XS,
]
# where each type keeps its fp16 scales (byte offsets in the block); Q8_K's f32 scale is at 0
F16_FIELDS = {
    QT.Q4_0: (0,),
    QT.Q8_0: (0,),
    QT.Q5_0: (0,),
    QT.Q5_1: (0, 2),
    QT.Q2_K: (80, 82),
    QT.Q3_K: (108,),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
    QT.IQ4_NL: (0,),
    QT.IQ4_XS: (0,),
}


def random_blocks(qtype: QT, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """``n_blocks`` random blocks of ``qtype``, a (n_blocks, type_size) uint8 array with finite scales."""
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype, ()):
        raw[:, off : off + 2] = (rng.standard_normal((n_blocks, 1)) * 0.01).astype(np.float16).view(np.uint8)
    if qtype == QT.Q8_K:
        raw[:, 0:4] = (rng.standard_normal((n_blocks, 1)) * 0.01).astype(np.float32).view(np.uint8)
    return raw


def median_seconds(fn: Callable[[], Any], reps: int) -> float:
    """Median wall time of ``fn`` over ``reps`` runs (after one warm-up run)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def reference(raw: np.ndarray, qtype: QT) -> np.ndarray:
    """gguf's dequantization; Q8_K, which gguf lacks, as ggml's ``y = d * q`` in numpy."""
    if qtype == QT.Q8_K:
        b = raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
        return b[:, :4].copy().view(np.float32) * b[:, 4:260].copy().view(np.int8).astype(np.float32)
    return gguf.quants.dequantize(raw, qtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=16.0, help="quantized megabytes per type")
    ap.add_argument("--row", type=int, default=4096, help="values per row (a multiple of 256)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (numpy is single-threaded)"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(
        f"torch threads={args.threads}, {args.mb:g} MB per type in rows of {args.row} values, "
        f"median of {args.reps}"
    )
    print(f"{'type':8} {'ours MB/s':>10} {'gguf MB/s':>10} {'speedup':>8}")
    for qtype in TYPES:
        block_values, type_size = gguf.GGML_QUANT_SIZES[qtype]
        per_row = args.row // block_values
        rows = max(1, int(args.mb * 1e6) // (type_size * per_row))
        raw = random_blocks(qtype, rows * per_row, rng).reshape(rows, per_row * type_size)
        flat = torch.from_numpy(raw.reshape(-1))
        fn = _DEQUANT[int(qtype)]
        ours = fn(flat)
        ref = torch.from_numpy(np.ascontiguousarray(reference(raw, qtype), dtype=np.float32))
        if not torch.equal(ours.reshape(-1).view(torch.int32), ref.reshape(-1).view(torch.int32)):
            raise SystemExit(f"{qtype.name}: dequantization differs from the reference")
        t_ours = median_seconds(partial(fn, flat), args.reps)
        t_ref = median_seconds(partial(reference, raw, qtype), args.reps)
        mb = raw.nbytes / 1e6
        print(f"{qtype.name:8} {mb / t_ours:10.0f} {mb / t_ref:10.0f} {t_ref / t_ours:7.1f}x")


if __name__ == "__main__":
    main()
