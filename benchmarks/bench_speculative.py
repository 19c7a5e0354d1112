"""Speculative decoding by draft source: plain vs prompt lookup vs MTP vs auto, on one checkpoint.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_speculative.py --model <folder>
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_speculative.py --model <folder> --quick

``--model`` is any model folder the engine loads; MTP rows need a DeepSeek V3 or V4 checkpoint with
MTP layers (``model.layers.{num_hidden_layers + i}.*``) and read ``n/a`` elsewhere. Every source runs
on the same loaded weights, greedy, prefix caching off, ``--threads`` CPU threads; ``--draft-vocab``,
``--confidence`` and ``--speculative-tokens`` set the MTP draft vocabulary, the confidence base and
the longest draft (default: the engine's).

Workloads: ``text``, free continuation of prose (docstrings of the Python standard library, which
any machine has); ``json``, extraction of a small record into a JSON Schema (structured output, so
grammar masks and forced tokens are on). Concurrency 1: requests one at a time; 16: all requests
submitted together (``max_num_seqs`` 16).

Per row: tokens/s (generated tokens / wall time of the row, median over ``--repeats`` passes, the
sources interleaved per pass so machine load hits them alike) and its ratio to ``plain`` from the
same pass; the same by the process's CPU time (all its threads), which other programs on a shared
machine disturb less than the wall clock; mean accepted length (accepted draft tokens per verification,
every source: forced boundary drafts of one or two tokens count too), and the same of the MTP drafts
alone; draft tokens and the
share accepted; % steps with a draft (of the passes that sampled for a request, counted at the executor, those
that fed it a draft); and % identical (greedy outputs equal to ``plain`` token for token). Results: a markdown table on
stdout, raw JSON in ``bench_results/speculative-<UTC>.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from agent_infer import LLM, SamplingParams
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.errors import ConfigError
from agent_infer.model.loader import load_model

SOURCES = {"plain": "off", "ngram": "ngram", "mtp": "mtp", "auto": "auto"}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 40},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
_PEOPLE = [("Ada Lovelace", 36, "London"), ("Alan Turing", 41, "Wilmslow"), ("Grace Hopper", 85, "Arlington"),
           ("Edsger Dijkstra", 72, "Nuenen"), ("Barbara Liskov", 84, "Boston"), ("Donald Knuth", 86, "Stanford"),
           ("Katherine Johnson", 101, "Newport News"), ("John Backus", 82, "Ashland")]  # fmt: skip


def text_prompts(n: int) -> list[str]:
    """Openings of standard-library docstrings (offline prose every machine has)."""
    import collections
    import json as json_mod
    import pathlib
    import textwrap

    docs = [m.__doc__ or "" for m in (json_mod, textwrap, collections, pathlib, argparse, statistics, time)]
    docs += [f.__doc__ or "" for f in (sorted, textwrap.wrap, json_mod.dumps, statistics.median, Path.glob)]
    docs = [" ".join(d.split())[:400] for d in docs if len(d) > 80]
    return [docs[i % len(docs)] for i in range(n)]


def json_prompts(n: int) -> list[str]:
    """Extraction requests quoting an example record (values the output copies)."""
    out = []
    for i in range(n):
        name, age, city = _PEOPLE[i % len(_PEOPLE)]
        ex = _PEOPLE[(i + 3) % len(_PEOPLE)]
        out.append(
            f'Example: {{"name": "{ex[0]}", "age": {ex[1]}, "city": "{ex[2]}"}}. '
            f"Extract the person as JSON: {name} is {age} years old and lives in {city}."
        )
    return out


@dataclass
class Row:
    workload: str
    concurrency: int
    source: str
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    verifications: int = 0
    mtp_accepted: int = 0
    mtp_verifications: int = 0
    decode_steps: int = 0
    draft_steps: int = 0
    identical: float = 0.0
    note: str = ""


class StepCounter:
    """Counts, through the engine's executor, the passes that sampled for a request and those among
    them that fed a draft."""

    def __init__(self, llm: LLM) -> None:
        self.steps = 0
        self.with_draft = 0
        executor = llm.engine.executor
        run = executor.run

        def counted(batch: list[Any]) -> Any:
            for item in batch:
                if item.samples:
                    self.steps += 1
                    self.with_draft += bool(item.draft)
            return run(batch)

        executor.run = counted  # type: ignore[method-assign]


def run_once(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, concurrency: int
) -> tuple[float, float, list[Any]]:
    start, cpu = time.perf_counter(), time.process_time()
    if concurrency == 1:
        outs = [llm.generate([p], params)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, params)
    return time.perf_counter() - start, time.process_time() - cpu, outs


def account(row: Row, outs: list[Any]) -> None:
    row.tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    row.drafted = sum(o.metrics.num_draft_tokens for o in outs)
    row.accepted = sum(o.metrics.num_accepted_draft_tokens for o in outs)
    row.verifications = sum(s.verifications for o in outs for s in o.metrics.draft_sources.values())
    mtp = [o.metrics.draft_sources["mtp"] for o in outs if "mtp" in o.metrics.draft_sources]
    row.mtp_accepted = sum(s.accepted for s in mtp)
    row.mtp_verifications = sum(s.verifications for s in mtp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", required=True, help="model folder (a V3 checkpoint with MTP layers for MTP rows)"
    )
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-mib", type=int, default=96, help="KV cache per engine (MiB)")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--workloads", default="text,json")
    ap.add_argument("--draft-vocab", type=int, default=None, help="MTP draft vocabulary (0 = whole)")
    ap.add_argument("--confidence", type=float, default=None, help="MTP confidence base")
    ap.add_argument("--speculative-tokens", type=int, default=None, help="longest draft (engine default 5)")
    ap.add_argument("--quick", action="store_true", help="4 requests, 32 tokens, one pass")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.max_tokens, args.repeats = 4, 32, 1
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    # One engine per source (concurrency 1 runs requests one at a time on the same engine).
    engines: dict[str, LLM | None] = {}
    max_seqs = max(map(int, args.concurrency.split(",")))
    extra: dict[str, Any] = {}
    if args.draft_vocab is not None:
        extra["speculative_draft_vocab"] = args.draft_vocab
    if args.confidence is not None:
        extra["speculative_confidence"] = args.confidence
    if args.speculative_tokens is not None:
        extra["speculative_tokens"] = args.speculative_tokens
    for name, source in SOURCES.items():
        try:
            config = EngineConfig(
                speculative_source=source,
                enable_prefix_caching=False,
                max_num_seqs=max_seqs,
                kv_cache_memory_bytes=args.kv_mib << 20,
                **extra,
            )
            engines[name] = LLM.from_engine(LLMEngine(config=config, loaded=loaded))
        except ConfigError as exc:
            engines[name] = None
            print(f"{name}: n/a ({exc})")
    counters = {name: StepCounter(llm) for name, llm in engines.items() if llm is not None}
    drafter = next(
        (
            e.engine.speculator.mtp
            for e in engines.values()
            if e is not None and e.engine.speculator and e.engine.speculator.mtp
        ),
        None,
    )
    if drafter is not None:
        print(
            f"MTP: {drafter.depth} module(s), draft vocabulary {drafter.vocab.size} ids ({drafter.vocab.source})"
        )
    rows: list[Row] = []
    any_llm = next(e for e in engines.values() if e is not None)
    limit = any_llm.engine.max_model_len - args.max_tokens - 1
    for workload in args.workloads.split(","):
        texts = text_prompts(args.requests) if workload == "text" else json_prompts(args.requests)
        # Token ids, cut from the front to fit a small model's context (the request is at the end).
        prompts = [any_llm.tokenizer.encode(t)[-limit:] for t in texts]
        structured = SCHEMA if workload == "json" else None
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured=structured)
        for conc in map(int, args.concurrency.split(",")):
            group = {name: Row(workload, conc, name) for name in SOURCES}
            for llm in (e for e in engines.values() if e is not None):
                run_once(llm, prompts, params, conc)  # warm-up: grammar compiles, first calls of each shape
            plain_tokens: list[list[int]] = []
            for _ in range(args.repeats):
                for name in SOURCES:
                    llm = engines[name]
                    row = group[name]
                    if llm is None:
                        row.note = "n/a"
                        continue
                    counter = counters[name]
                    before = (counter.steps, counter.with_draft)
                    wall, cpu, outs = run_once(llm, prompts, params, conc)
                    row.walls.append(wall)
                    row.cpus.append(cpu)
                    account(row, outs)
                    row.decode_steps = counter.steps - before[0]
                    row.draft_steps = counter.with_draft - before[1]
                    tokens = [o.outputs[0].token_ids for o in outs]
                    if name == "plain":
                        plain_tokens = tokens
                    row.identical = sum(a == b for a, b in zip(tokens, plain_tokens)) / len(tokens)
            rows.extend(group.values())
    print_table(rows)
    out = Path("bench_results") / f"speculative-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps({"model": args.model, "args": vars(args), "rows": [asdict(r) for r in rows]}, indent=1)
    )
    print(f"\nraw: {out}")


def _ratio(r: Row, base: Row | None, times: str) -> str:
    """Median over passes of the row's tokens/s over the same pass's plain tokens/s."""
    if base is None or not getattr(base, times):
        return ""
    ratios = [(r.tokens / t) / (base.tokens / b) for t, b in zip(getattr(r, times), getattr(base, times))]
    return f"{statistics.median(ratios):.2f}x"


def print_table(rows: list[Row]) -> None:
    print(
        "| workload | conc | source | tok/s | vs plain | CPU tok/s | vs plain (CPU) | "
        "mean accepted / verification | MTP drafts: accepted / verification | drafted | accepted % | "
        "% steps with a draft | % identical |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    plain = {(r.workload, r.concurrency): r for r in rows if r.source == "plain"}
    for r in rows:
        if not r.walls:
            print(f"| {r.workload} | {r.concurrency} | {r.source} | n/a | | | | | | | | | |")
            continue
        base = plain.get((r.workload, r.concurrency))
        tps = r.tokens / statistics.median(r.walls)
        cpu_tps = r.tokens / statistics.median(r.cpus)
        mean_acc = r.accepted / r.verifications if r.verifications else 0.0
        mtp_acc = f"{r.mtp_accepted / r.mtp_verifications:.2f}" if r.mtp_verifications else "-"
        acc_pct = 100 * r.accepted / r.drafted if r.drafted else 0.0
        steps_pct = 100 * r.draft_steps / r.decode_steps if r.decode_steps else 0.0
        print(
            f"| {r.workload} | {r.concurrency} | {r.source} | {tps:.1f} | {_ratio(r, base, 'walls')} | "
            f"{cpu_tps:.1f} | {_ratio(r, base, 'cpus')} | {mean_acc:.2f} | {mtp_acc} | {r.drafted} | {acc_pct:.0f}% | "
            f"{steps_pct:.0f}% | {100 * r.identical:.0f}% |"
        )


if __name__ == "__main__":
    main()
