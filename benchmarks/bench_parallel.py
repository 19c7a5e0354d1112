"""Parallel MoE serving on this machine, and a paper model of it at DeepSeek-V3 scale.

Run: ``OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_parallel.py [--requests 32]
[--max-tokens 32] [--cp-len 1024] [--cp-threshold 512] [--model DIR] [--skip-serving] [--skip-cp]
[--paper-only]``.

1. **Serving**: ``--requests`` concurrent greedy requests (``--max-tokens`` each, EOS ignored) on a
   random DeepSeek-V3-layout checkpoint written to a temporary folder (the shapes are in
   :data:`BENCH_MODEL`; ``--model checkpoints/tiny-deepseek-v3`` runs the trained tiny V3), for DP=1 (one process), DP=2 (each rank all
   experts), DP=2 + EP, DP=2 + EP + EPLB (redundant experts, rebalanced every 16 steps). Aggregate
   tokens/s, p50/p95 inter-token latency, and for the EP runs where a rank's busy step time went:
   waiting for the other rank (the count exchange of each MoE layer), moving rows (all-to-all),
   local expert matmuls, idle passes; all-to-all bytes per step; tokens per rank; the expert
   imbalance (max/mean rank load) before and after the first rebalance; the weights each rank
   holds (under EP only its experts are read from the checkpoint).
2. **Context-parallel prefill** of one ``--cp-len``-token prompt at model level: single rank (all
   threads) vs 2 ranks (one thread each), median of 3, and the largest logit difference; then in
   the engine: time to first token of three such prompts on a DP=2 engine, prefilled by the owner
   rank alone vs context-parallel (``--cp-threshold``), the ranks' prefill time per job, and
   whether the greedy tokens match.
3. **Paper model** (``--paper-only`` prints just this): bytes per token through the all-to-all and
   expert imbalance with and without EPLB at 8 and 64 ranks, with DeepSeek-V3's real sizes.

The box has 2 cores, so DP=2 cannot be faster than DP=1 here; the point is the overhead breakdown.
Tables go to stdout as markdown, progress to stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Before torch loads OpenMP: spinning worker threads would steal the other ranks' cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
from parallel_paper import paper_model

from agent_infer.engine.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.parallel import DataParallelEngine, ParallelConfig
from agent_infer.parallel.expert_loading import resident_weight_bytes
from agent_infer.sampling_params import SamplingParams

#: The benchmark checkpoint: DeepSeek V3's layout (MLA, sigmoid group-limited routing, shared expert).
BENCH_MODEL: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
    num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
    n_shared_experts=1, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4,
    routed_scaling_factor=2.5, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16,
    qk_nope_head_dim=32, v_head_dim=32, max_position_embeddings=4096, num_nextn_predict_layers=0,
    tie_word_embeddings=False, eos_token_id=0, bos_token_id=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)  # fmt: skip

PROMPTS = [
    "Summarize the plot of a detective story set in a lighthouse.",
    "List the planets of the solar system with one fact each.",
    "Explain how a hash map handles collisions.",
    "Write a short poem about rain on a tin roof.",
    "Describe the rules of chess for a beginner.",
    "What are three uses of a paperclip?",
    "Give a recipe for pancakes.",
    "Translate 'good morning' into five languages.",
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_checkpoint(directory: Path) -> None:
    """A random V3-layout checkpoint of unit-scale activations with the SmolLM2 tokenizer."""
    import transformers

    from agent_infer.model.loader import default_model_path
    from agent_infer.model.loading.gguf_reader import GGUFFile
    from agent_infer.model.tokenizer import Tokenizer

    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**BENCH_MODEL)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.2 * noise)
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))
        for layer in model.model.layers[1:]:  # a skewed router: experts 0 and 1 hot, as real loads are
            layer.mlp.gate.e_score_correction_bias[:2] += 1.0
    model.save_pretrained(directory)
    tok = Tokenizer.from_gguf_metadata(GGUFFile(default_model_path()).metadata)
    tok.hf_tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": tok.chat_template})
    )


def drive(engine: Any, requests: int, max_tokens: int) -> dict[str, float]:
    """Submit every request at once and step to the end; throughput and inter-token latencies."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    for i in range(requests):
        engine.add_request(f"b{i}", PROMPTS[i % len(PROMPTS)] + f" (variant {i})", params)
    seen: dict[str, int] = {}
    last: dict[str, float] = {}
    gaps: list[float] = []
    done = 0
    while done < requests:
        for out in engine.step():
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            new = n - seen.get(out.request_id, 0)
            if new > 0 and out.request_id in last:
                gaps.extend([(now - last[out.request_id]) / new] * new)
            if new > 0:
                last[out.request_id] = now
                seen[out.request_id] = n
            if out.finished:
                done += 1
    wall = time.perf_counter() - start
    gaps.sort()
    return {
        "tok_s": sum(seen.values()) / wall,
        "wall_s": wall,
        "itl_p50_ms": 1000 * gaps[len(gaps) // 2] if gaps else 0.0,
        "itl_p95_ms": 1000 * gaps[int(len(gaps) * 0.95)] if gaps else 0.0,
    }


def serving(model_dir: str, args: argparse.Namespace) -> None:
    config = EngineConfig(kv_cache_memory_bytes=64 * 1024 * 1024, speculative_tokens=0)
    runs: list[tuple[str, ParallelConfig | None]] = [
        ("DP=1", None),
        ("DP=2", ParallelConfig(data_parallel_size=2)),
        ("DP=2 + EP", ParallelConfig(data_parallel_size=2, expert_parallel=True)),
        (
            "DP=2 + EP + EPLB",
            ParallelConfig(
                data_parallel_size=2,
                expert_parallel=True,
                redundant_experts=4,
                eplb_interval=16,
                eplb_window=64,
            ),
        ),
    ]
    rows = []
    breakdown = []
    weights: list[tuple[str, dict[int, int], dict[int, Any]]] = []
    for name, parallel in runs:
        log(f"serving: {name}")
        if parallel is None:
            engine: Any = LLMEngine(model_dir, config)
            drive(engine, 2, 2)  # warm-up
            result = drive(engine, args.requests, args.max_tokens)
            engine.grammar.shutdown()
            metrics: dict[int, Any] = {}
            held = {0: resident_weight_bytes(engine.runner.model)}
        else:
            engine = DataParallelEngine(model_dir, config, parallel)
            try:
                drive(engine, 2, 2)
                result = drive(engine, args.requests, args.max_tokens)
                metrics = engine.collect_metrics()
                held = {r: st["weight_bytes"] for r, st in sorted(engine.rank_status.items())}
            finally:
                engine.shutdown()
        rows.append((name, result))
        weights.append((name, held, metrics))
        for rank, m in sorted(metrics.items()):
            if m is not None:
                breakdown.append((name, rank, m))
    print("\n### Serving: aggregate throughput and inter-token latency\n")
    print(
        f"{args.requests} concurrent requests x {args.max_tokens} tokens, greedy, "
        f"{args.model or 'random V3-layout model'}.\n"
    )
    print("| run | tok/s | wall s | ITL p50 ms | ITL p95 ms | tok/s vs DP=1 |")
    print("|---|---:|---:|---:|---:|---:|")
    base = rows[0][1]["tok_s"]
    for name, r in rows:
        print(
            f"| {name} | {r['tok_s']:.1f} | {r['wall_s']:.2f} | {r['itl_p50_ms']:.1f} | {r['itl_p95_ms']:.1f} "
            f"| {r['tok_s'] / base:.2f} |"
        )
    print("\n### Weights each rank holds\n")
    print(
        "Bytes of weights resident per rank (parameters, buffers and expert slots); under EP a rank "
        "reads only its slots' experts from the checkpoint (experts read: at load and by moves).\n"
    )
    print("| run | rank | weights MiB | vs DP=1 | experts read MiB |")
    print("|---|---:|---:|---:|---:|")
    full = weights[0][1][0]
    for name, held, metrics in weights:
        for rank, n in held.items():
            m = metrics.get(rank)
            read = f"{m.expert_bytes_read / 2**20:.2f}" if m is not None and m.experts_read else "-"
            print(f"| {name} | {rank} | {n / 2**20:.2f} | {n / full:.3f} | {read} |")
    print("\n### Expert-parallel ranks: where a busy step's time goes (whole run, warm-up included)\n")
    print(
        "| run | rank | busy steps | step s | wait for peer s | all-to-all s | experts s | idle passes s "
        "| a2a KiB/step | tokens per rank | imbalance first rebalance |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for name, rank, m in breakdown:
        first = m.imbalance_history[0] if m.imbalance_history else None
        imb = f"{first[0]:.2f} -> {first[1]:.2f}" if first else "-"
        print(
            f"| {name} | {rank} | {m.steps} | {m.step_seconds:.2f} | {m.wait_seconds:.2f} | "
            f"{m.transfer_seconds:.2f} | {m.expert_seconds:.2f} | {m.idle_pass_seconds:.2f} | "
            f"{m.dispatch_bytes_per_step / 1024:.1f} | {m.total_tokens_per_rank} | {imb} |"
        )


def _cp_rank(rank: int, world: int, port: int, model_dir: str, prompt: list[int], out: Any) -> None:
    from agent_infer.accelerator import get_accelerator
    from agent_infer.model.loading.hf import hf_config, hf_weights
    from agent_infer.model.registry import build_model
    from agent_infer.parallel.context_parallel import context_parallel_prefill
    from agent_infer.parallel.group import GroupSpec, close_group, init_group

    torch.set_num_threads(1)
    init_group(GroupSpec(world, "127.0.0.1", port, 300.0), rank, get_accelerator("cpu"))
    model = build_model(hf_config(model_dir))
    model.load_weights(hf_weights(model_dir))
    times = []
    for _ in range(3):
        torch.distributed.barrier()
        t = time.perf_counter()
        result = context_parallel_prefill(model.eval(), prompt)  # type: ignore[arg-type]
        times.append(time.perf_counter() - t)
    if rank == 0:
        out.put((statistics.median(times), result.logits[-1].numpy().tobytes()))
    close_group()


def context_parallel(model_dir: str, args: argparse.Namespace) -> None:
    import numpy as np
    import torch.multiprocessing as mp

    from agent_infer.model.loading.hf import hf_config, hf_weights
    from agent_infer.model.registry import build_model
    from agent_infer.model.runner import SequenceRunner
    from agent_infer.parallel.group import free_port

    log(f"context parallel: {args.cp_len}-token prompt")
    prompt = torch.randint(2, 49152, (args.cp_len,), generator=torch.Generator().manual_seed(1)).tolist()
    model = build_model(hf_config(model_dir))
    model.load_weights(hf_weights(model_dir))
    model.eval()
    times = []
    for _ in range(3):
        runner = SequenceRunner(model, num_blocks=args.cp_len // 16 + 2, block_size=16)
        t = time.perf_counter()
        single = runner.step([(0, prompt)])[0]
        times.append(time.perf_counter() - t)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_cp_rank, args=(r, 2, port, model_dir, prompt, out)) for r in range(2)]
    for p in procs:
        p.start()
    cp_time, raw = out.get(timeout=600)
    for p in procs:
        p.join()
    cp_last = torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy())
    diff = (cp_last - single).abs().max().item()
    print("\n### Context-parallel prefill\n")
    print(f"One {args.cp_len}-token prompt, median of 3.\n")
    print("| run | threads | prefill s | max abs logit diff vs single rank |")
    print("|---|---:|---:|---:|")
    print(f"| single rank | {torch.get_num_threads()} | {statistics.median(times):.3f} | 0 |")
    print(f"| CP over 2 ranks (zig-zag) | 1 per rank | {cp_time:.3f} | {diff:.2e} |")


def engine_cp(model_dir: str, args: argparse.Namespace) -> None:
    """Time to first token of long prompts on a DP=2 engine: prefilled by the owner rank alone
    (one thread) vs context-parallel over both ranks (one thread each)."""
    config = EngineConfig(kv_cache_memory_bytes=128 * 1024 * 1024, speculative_tokens=0)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 40000, (args.cp_len,), generator=gen).tolist() for _ in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    rows = []
    for name, threshold in (("DP=2, prefill on the owner rank", 0), ("DP=2 + CP prefill", args.cp_threshold)):
        log(f"engine context parallel: {name}")
        engine = DataParallelEngine(
            model_dir, config, ParallelConfig(data_parallel_size=2, cp_prefill_threshold=threshold)
        )
        try:
            drive(engine, 2, 2)
            ttfts, tokens = [], []
            for i, prompt in enumerate(prompts):
                start = time.perf_counter()
                engine.add_request(f"cp{i}", prompt, params)
                first, done = None, None
                while done is None:
                    for out in engine.step():
                        if first is None and out.outputs[0].token_ids:
                            first = time.perf_counter() - start
                        if out.finished:
                            done = out
                ttfts.append(first or 0.0)
                tokens.append(done.outputs[0].token_ids)
            time.sleep(0.6)
            engine.step()
            stats = {r: st.get("cp_prefill") for r, st in sorted(engine.rank_status.items())}
        finally:
            engine.shutdown()
        rows.append((name, ttfts, stats, tokens))
    print("\n### Context-parallel prefill in the engine\n")
    print(
        f"Three {args.cp_len}-token prompts one after another on a DP=2 engine (threshold "
        f"{args.cp_threshold}); 8 greedy tokens each. CP prefill s: the ranks' mean wall time per job.\n"
    )
    print(
        "| run | TTFT median s | TTFTs s | CP prefill s/job (rank 0, rank 1) | tokens equal to the owner-only run |"
    )
    print("|---|---:|---|---|---|")
    for name, ttfts, stats, tokens in rows:
        per_job = ", ".join(
            f"{st.seconds / st.prefills:.2f}" for st in stats.values() if st is not None and st.prefills
        )
        same = "-" if name.startswith("DP=2, prefill") else str(tokens == rows[0][3])
        print(
            f"| {name} | {statistics.median(ttfts):.2f} | {', '.join(f'{t:.2f}' for t in ttfts)} "
            f"| {per_job or '-'} | {same} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cp-len", type=int, default=1024)
    parser.add_argument("--cp-threshold", type=int, default=512, help="engine CP threshold (tokens)")
    parser.add_argument(
        "--model", default=None, help="a DeepSeek V3 folder instead of the random V3-layout checkpoint"
    )
    parser.add_argument("--skip-cp", action="store_true", help="no context-parallel sections")
    parser.add_argument("--paper-only", action="store_true")
    parser.add_argument("--skip-serving", action="store_true", help="context parallel and paper model only")
    args = parser.parse_args()
    if not args.paper_only:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = args.model
            if model_dir is None:
                write_checkpoint(Path(tmp))
                model_dir = tmp
            if not args.skip_serving:
                serving(model_dir, args)
            if not args.skip_cp:
                context_parallel(model_dir, args)
                engine_cp(model_dir, args)
    paper_model()
    return 0


if __name__ == "__main__":
    sys.exit(main())
