"""Where a DeepSeek decode step's time goes, per phase, on our engine (CPU).

Loads ``--model`` (a DeepSeek V3 or V4 Hugging Face folder, e.g. ``checkpoints/tiny-deepseek-v3``),
submits ``--concurrency`` random prompts, lets the prefill and a warm-up pass, then decodes
``--steps`` steps with every phase's functions wrapped by a timer. Time is charged to the innermost
running phase (a projection inside MLA counts as a projection, not as MLA), so the rows add up to
the step; the MTP drafter's own forward is also shown inclusive (its layers' time is in the
layer rows too). Both wall and process CPU time are shown: on a shared machine wall time includes
waiting for a core, CPU time does not.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/profile_deepseek.py --model checkpoints/tiny-deepseek-v3

``--speculative 0`` turns speculative decoding off (plain one-token steps). ``--prefill 32 256 1024``
instead times one request's prefill (time to the first token, wall and CPU, median of 3 after a
warm-up) per prompt length; with ``AGENT_INFER_NATIVE_LINEAR=0`` the same on the torch path.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import functools
import resource
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch


class PhaseClock:
    """Exclusive wall and CPU time per phase name, with a stack of running phases."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.inclusive: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        self.stack: list[str] = []
        self.mark = (time.perf_counter(), time.process_time())
        self.on = False

    def _charge(self) -> None:
        now = (time.perf_counter(), time.process_time())
        if self.stack:
            top = self.stack[-1]
            self.wall[top] += now[0] - self.mark[0]
            self.cpu[top] += now[1] - self.mark[1]
        self.mark = now

    def wrap(self, owner: Any, attr: str, phase: str, inclusive: bool = False) -> None:
        """Replace ``owner.attr`` by a timed version charging ``phase``."""
        fn: Callable[..., Any] = getattr(owner, attr)
        if getattr(fn, "__phase__", None) == phase:  # inherited from a class wrapped already
            return
        clock = self

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not clock.on:
                return fn(*args, **kwargs)
            clock._charge()
            clock.stack.append(phase)
            clock.calls[phase] += 1
            start = (time.perf_counter(), time.process_time())
            try:
                return fn(*args, **kwargs)
            finally:
                clock._charge()
                clock.stack.pop()
                if inclusive:
                    inc = clock.inclusive[phase]
                    inc[0] += time.perf_counter() - start[0]
                    inc[1] += time.process_time() - start[1]

        timed.__phase__ = phase  # type: ignore[attr-defined]
        setattr(owner, attr, timed)


def instrument(clock: PhaseClock) -> None:
    """Wrap the engine's and the DeepSeek layers' phase entry points."""
    from agent_infer.engine import executor, llm_engine, model_runner, postprocessor, sampler, scheduler
    from agent_infer.engine import speculator as spec
    from agent_infer.engine.drafts import mtp
    from agent_infer.model.families import deepseek_v3, deepseek_v4
    from agent_infer.model.layers import (
        attention,
        compressed_attention,
        float_linear,
        hyper_connections,
        interleaved_rotary,
        linear,
        mla,
        moe,
        norm,
        qlinear,
    )

    w = clock.wrap
    w(llm_engine.LLMEngine, "step", "engine other")
    w(scheduler.Scheduler, "schedule", "scheduler")
    w(postprocessor.Postprocessor, "process", "postprocess")
    w(spec.Speculator, "propose_all", "drafts (other)")
    w(mtp.MTPDrafter, "_forward", "MTP module forward (incl.)", inclusive=True)
    w(executor.Executor, "_forward_and_choose", "executor other")
    w(sampler.Sampler, "__call__", "sampling")
    w(spec.Speculator, "verify", "sampling")
    w(model_runner.ModelRunner, "run", "runner prep")
    for fam in (deepseek_v3.DeepseekV3ForCausalLM, deepseek_v4.DeepseekV4ForCausalLM):
        w(fam, "forward", "forward other (embed, residuals, layer loop)")
        w(fam, "compute_logits", "LM head")
    w(attention.PagedAttention, "plan", "attention plan")
    w(deepseek_v4, "plan_compressed", "attention plan")
    w(mla.MultiHeadLatentAttention, "forward", "MLA (norms, RoPE, cache, attend)")
    w(compressed_attention.CompressedAttention, "forward", "V4 attention (all but projections)")
    w(compressed_attention.CompressedAttention, "_attend_decode", "V4 attention: decode rows attend")
    w(
        compressed_attention.CompressedAttention,
        "_close_decode",
        "V4 attention: windows closed by decode rows",
    )
    w(compressed_attention.CompressedAttention, "_attend", "V4 attention: chunks attend")
    # The packed path's decode rows (layers/compressed_native.py), as compressed_attention calls them.
    w(compressed_attention.compressed_native, "attend", "V4 attention: decode rows attend")
    w(compressed_attention.compressed_native, "close_windows", "V4 attention: windows closed by decode rows")
    w(interleaved_rotary.InterleavedRotary, "tables", "V4 RoPE")
    w(interleaved_rotary.InterleavedRotary, "apply", "V4 RoPE")
    w(interleaved_rotary.InterleavedRotary, "norm_apply", "V4 RoPE")
    w(norm.RMSNorm, "forward", "norms")
    w(moe.MoE, "route", "MoE routing (torch path)")
    w(moe.MoE, "forward", "MoE routing + grouping + experts")
    w(moe.MoE, "forward_normed", "MoE routing + grouping + experts")
    for fn in ("collapse",):
        w(hyper_connections.HyperConnection, fn, "hyper-connections")
    w(hyper_connections.HyperHead, "forward", "hyper-connections")
    w(deepseek_v4, "expand", "hyper-connections")
    for cls in (linear.TorchLinear, qlinear.QuantLinear, float_linear.FloatPackedLinear):
        w(cls, "project", "projections")
        w(cls, "project_normed", "projections")
        w(cls, "logits", "LM head")


def prefill(engine: Any, lengths: list[int], vocab: int) -> None:
    """Print the median time to the first token of one request per prompt length."""
    import statistics

    from agent_infer.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    print(f"kernels {engine.runner.model.kernels.name}; one request; median of 3 after a warm-up")
    print(f"{'prompt tokens':>14}{'TTFT wall ms':>14}{'TTFT CPU ms':>13}")
    for length in lengths:
        wall, cpu = [], []
        for rep in range(4):
            prompt = torch.randint(2, vocab, (length,), generator=gen).tolist()
            start = (time.perf_counter(), time.process_time())
            engine.add_request(f"p{length}-{rep}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
            while engine.has_unfinished_requests():
                engine.step()
            if rep:
                wall.append(time.perf_counter() - start[0])
                cpu.append(time.process_time() - start[1])
        print(f"{length:>14}{statistics.median(wall) * 1e3:>14.1f}{statistics.median(cpu) * 1e3:>13.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--speculative", type=int, default=None, help="speculative_tokens (default: the engine's)"
    )
    ap.add_argument(
        "--prefill", type=int, nargs="*", default=None, help="time the prefill of these prompt lengths"
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["AGENT_INFER_NUM_THREADS"] = str(args.threads)

    from agent_infer.engine.config import EngineConfig
    from agent_infer.engine.llm_engine import LLMEngine
    from agent_infer.model.loader import load_model
    from agent_infer.sampling_params import SamplingParams

    loaded = load_model(args.model, device=torch.device("cpu"), dtype=torch.float32)
    kw: dict[str, Any] = {"enable_prefix_caching": False}
    if args.speculative is not None:
        kw["speculative_tokens"] = args.speculative
    engine = LLMEngine(config=EngineConfig(**kw), loaded=loaded)
    if args.prefill:
        prefill(engine, args.prefill, loaded.config.vocab_size)
        return
    clock = PhaseClock()
    instrument(clock)
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.config.vocab_size
    prompts = [
        torch.randint(2, vocab, (args.prompt_len + i % 5,), generator=gen).tolist()
        for i in range(args.concurrency)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.steps * 8 + 64, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    for _ in range(6):  # prefill and warm-up
        engine.step()
    clock.on = True
    counts: dict[str, int] = {}
    for out in engine.step():
        counts[out.request_id] = len(out.token_ids)
    before = sum(counts.values())
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = (time.perf_counter(), time.process_time())
    for _ in range(args.steps):
        for out in engine.step():
            counts[out.request_id] = len(out.token_ids)
    wall, cpu = time.perf_counter() - start[0], time.process_time() - start[1]
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    tokens = sum(counts.values()) - before
    clock.on = False
    print(
        f"model {args.model}; {args.concurrency} concurrent; {args.steps} decode steps; "
        f"threads {args.threads}; speculative_tokens {engine.config.speculative_tokens}"
    )
    print(
        f"step: wall {wall / args.steps * 1e3:.2f} ms, CPU {cpu / args.steps * 1e3:.2f} ms; "
        f"{tokens / args.steps:.1f} tokens/step: {tokens / wall:.1f} tok/s wall, {tokens / cpu:.1f} tok/CPU-s; "
        f"{faults / args.steps:.0f} page faults/step"
    )
    print(f"{'phase':<44}{'wall ms/step':>13}{'CPU ms/step':>13}{'calls/step':>12}")
    for name in sorted(clock.cpu, key=lambda k: -clock.cpu[k]):
        print(
            f"{name:<44}{clock.wall[name] / args.steps * 1e3:>13.2f}{clock.cpu[name] / args.steps * 1e3:>13.2f}"
            f"{clock.calls[name] / args.steps:>12.1f}"
        )
    for name, (wl, cp) in clock.inclusive.items():
        print(f"{name:<44}{wl / args.steps * 1e3:>13.2f}{cp / args.steps * 1e3:>13.2f}  (inclusive)")


if __name__ == "__main__":
    main()
