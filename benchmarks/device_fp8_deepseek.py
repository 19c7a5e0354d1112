"""FP8 weights kept as FP8 on an accelerator, for ``device_check.sh``: the trained tiny DeepSeek V3 and
V4 (``checkpoints/tiny-deepseek-v3``, ``-v4``: block-FP8 checkpoints, tracked in the repository).

Per model, on ``--device`` (default ``cuda``):

* ``AGENT_INFER_FP8_WEIGHTS=keep``, bfloat16: how many projections stay FP8 and which matmul each
  runs (``Fp8Linear.matmul``: ``blockwise`` on sm_90, ``per_group`` from sm_89).
* Teacher-forced logits of a fixed sequence (16 prompt ids, then 48 single-token steps through the
  paged cache) against the CPU float32 reference (FP8 dequantized at load): relative L2 error per
  position (median, max) and next-token agreement.
* Greedy decode tok/s at 1 and 16 concurrent requests (``speculative_tokens=0``, 64 tokens, EOS
  ignored, median of 3 after a warm-up), FP8 kept against the same weights dequantized to bfloat16
  on the same device.

Exit status 1 when a check fails: no projection kept on a device with FP8 matmuls, a median relative
error above the CPU tests' bounds (5% V3, 15% V4: models.md, "FP8 block checkpoints"), or next-token
agreement below 90%. ``--device cpu`` is the dry run (torch's CPU ``per_group`` kernel, slow).

    python3 benchmarks/device_fp8_deepseek.py --out $OUT/fp8_deepseek.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
BOUNDS = {"v3": 0.05, "v4": 0.15}
PROMPT, STEPS = 16, 48


def _load(path: Path, device: torch.device, dtype: torch.dtype, fp8: str) -> Any:
    from agent_infer.model.loader import load_model

    os.environ["AGENT_INFER_FP8_WEIGHTS"] = fp8
    return load_model(path, device=device, dtype=dtype)


def _teacher_forced(model: Any, ids: list[int]) -> torch.Tensor:
    """Float32 CPU logits ``[STEPS + 1, vocab]``: after the prompt, then after each further id."""
    from agent_infer.model.runner import SequenceRunner

    runner = SequenceRunner(model, num_blocks=16, block_size=16)
    rows = [runner.step([(0, ids[:PROMPT])])[0].float().cpu()]
    for t in ids[PROMPT : PROMPT + STEPS]:
        rows.append(runner.step([(0, [t])])[0].float().cpu())
    return torch.stack(rows)


def _decode_rate(loaded: Any, concurrency: int, vocab: int) -> float:
    """Median tok/s of ``concurrency`` greedy requests of 64 tokens (3 runs after a warm-up)."""
    from agent_infer.engine.config import EngineConfig
    from agent_infer.engine.llm_engine import LLMEngine
    from agent_infer.sampling_params import SamplingParams

    engine = LLMEngine(config=EngineConfig(speculative_tokens=0, enable_prefix_caching=False), loaded=loaded)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    rates = []
    for run in range(4):
        for i in range(concurrency):
            prompt = torch.randint(2, vocab, (20 + i % 5,), generator=gen).tolist()
            engine.add_request(f"{run}-{i}", prompt, params)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if loaded.model.device.type == "cuda":
            torch.cuda.synchronize()
        if run:
            rates.append(concurrency * 64 / (time.perf_counter() - start))
    return statistics.median(rates)


def check(name: str, device: torch.device) -> dict[str, Any]:
    """One model's FP8 report (see the module docstring)."""
    from agent_infer.model.layers.fp8_linear import Fp8Linear

    path = ROOT / "checkpoints" / f"tiny-deepseek-{name}"
    low = torch.bfloat16 if device.type != "cpu" else torch.float32
    reference = _load(path, torch.device("cpu"), torch.float32, "dequantize")
    vocab = reference.config.vocab_size
    ids = torch.randint(2, vocab, (PROMPT + STEPS,), generator=torch.Generator().manual_seed(0)).tolist()
    want = _teacher_forced(reference.model, ids)
    kept = _load(path, device, low, "keep")
    layers = [m for m in kept.model.modules() if isinstance(m, Fp8Linear)]
    got = _teacher_forced(kept.model, ids)
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).tolist()
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    dequantized = _load(path, device, low, "dequantize")
    report: dict[str, Any] = {
        "model": name,
        "device": str(device),
        "dtype": str(low),
        "fp8_layers": len(layers),
        "matmuls": dict(Counter(m.matmul for m in layers)),
        "rel_error_median": statistics.median(rel),
        "rel_error_max": max(rel),
        "next_token_agreement": agree,
    }
    for n in (1, 16):
        report[f"tok_s_{n}_fp8"] = _decode_rate(kept, n, vocab)
        report[f"tok_s_{n}_dequantized"] = _decode_rate(dequantized, n, vocab)
    failures = []
    if not layers and device.type == "cuda":
        from agent_infer.accelerator import get_accelerator

        if get_accelerator().fp8_matmuls():
            failures.append("no projection kept in FP8 on a device with FP8 matmuls")
    if report["rel_error_median"] > BOUNDS[name]:
        failures.append(f"median relative error {report['rel_error_median']:.3f} > {BOUNDS[name]}")
    if agree < 0.9:
        failures.append(f"next-token agreement {agree:.2f} < 0.9")
    report["failures"] = failures
    return report


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="v3,v4")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(2)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    reports = [check(name, device) for name in args.models.split(",")]
    text = json.dumps(reports, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 1 if any(r["failures"] for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
