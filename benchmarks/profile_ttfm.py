"""Where the compile-time (TTFM) tail comes from: ours and llguidance in one process, alternating.

For every schema of the sample, each round compiles it cold with each engine in turn (the same
cold setup as ``bench_grammar.py``: fresh ``TokenizerInfo`` and cleared front-end memos, untimed)
and times compile + first mask in process CPU time; a schema's figure is its median over the
rounds. Our compile is split into its phases: front end (``Grammar.from_json_schema``), program
serialization, native lowering, matcher + first mask. Prints the percentiles of both engines over
the schemas both compile, their ratio, and the schemas that hold our tail (the slowest ``--top``,
with llguidance's time beside each and our phase split).

Alternating in one process keeps the two engines on the same CPU at the same moment, which on a
box with drifting vCPU speed matters more than anything else; cross-process comparisons of a few
percent are not meaningful there.

    python benchmarks/profile_ttfm.py --tokenizer deepseek --limit 0 --rounds 3 --top 40
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_grammar as bg
from grammar_peers import CompileError, LLGuidanceEngine, OursEngine

PHASES = ("fe", "ser", "low", "fm")


def _ours_phases(engine: OursEngine, schema: Any) -> dict[str, float] | None:
    """One cold compile of ours, CPU µs per phase (None when the schema does not compile)."""
    from agent_infer.errors import AgentInferError
    from agent_infer.grammar.common.gc_pause import gc_paused
    from agent_infer.grammar.compile import compiler as gc_mod
    from agent_infer.grammar.compile.serialize import serialize_for_compile
    from agent_infer.native import load_native

    g = engine.g
    engine.before_schema()
    native_mask, _ = engine.allocate(1)
    gc.collect(0)
    t = [time.process_time_ns()]
    try:
        with gc_paused:
            grammar = g.Grammar.from_json_schema(schema, whitespace="compact")
            t.append(time.process_time_ns())
            programs, root = serialize_for_compile(grammar)
            t.append(time.process_time_ns())
            ext = load_native()
            make = ext.CompiledGrammar if isinstance(programs, list) else ext.compile_serialized
            comp = engine.compiler
            native = make(
                comp.tokenizer_info._native,
                programs,
                root,
                comp._max_states,
                comp._max_seconds,
                comp._max_items,
            )
            compiled = gc_mod.CompiledGrammar(grammar, comp.tokenizer_info, native)
            t.append(time.process_time_ns())
            matcher = g.GrammarMatcher(compiled)
            matcher.fill_next_token_bitmask(native_mask, 0)
            t.append(time.process_time_ns())
    except AgentInferError:
        return None
    return {p: (b - a) / 1e3 for p, a, b in zip(PHASES, t, t[1:])}


def _peer_ttfm(engine: LLGuidanceEngine, schema: Any) -> float | None:
    """One compile + first mask of the peer, CPU µs (None on a compile error)."""
    native_mask, _ = engine.allocate(1)
    engine.before_schema()
    gc.collect(0)
    c0 = time.process_time_ns()
    try:
        m = engine.compile(schema)
        m.fill(native_mask, 0)
    except CompileError:
        return None
    return (time.process_time_ns() - c0) / 1e3


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def main() -> int:
    """Runs the sample and prints both engines' TTFM percentiles and our tail with its phases."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bg.add_sample_args(ap)
    ap.add_argument("--rounds", type=int, default=3, help="compiles per schema and engine (median kept)")
    ap.add_argument("--top", type=int, default=30, help="slowest schemas of ours listed")
    ap.add_argument("--only", default="", help="comma-separated schema ids (substring match)")
    ap.add_argument("--no-peer", action="store_true", help="ours only")
    ap.add_argument("--json", type=Path, default=None, help="write per-schema results here")
    args = ap.parse_args()

    spec = bg.prepare_tokenizer(args.tokenizer)
    schemas = bg.load_schemas(Path(args.data), args.limit or None, args.seed)
    if args.only:
        wanted = args.only.split(",")
        schemas = [s for s in schemas if any(w in s["id"] for w in wanted)]
    ours = OursEngine(spec)
    peer = None if args.no_peer else LLGuidanceEngine(spec)
    gc.collect()
    gc.freeze()

    rows: list[dict[str, Any]] = []
    for i, s in enumerate(schemas):
        ph: list[dict[str, float]] = []
        pt: list[float] = []
        for _ in range(args.rounds):
            r = _ours_phases(ours, s["schema"])
            if r is None:
                break
            ph.append(r)
            if peer is not None:
                p = _peer_ttfm(peer, s["schema"])
                if p is not None:
                    pt.append(p)
        if ph:
            med = {k: statistics.median(r[k] for r in ph) for k in PHASES}
            total = statistics.median(sum(r.values()) for r in ph)
            rows.append({"id": s["id"], "ours": total, **med, "peer": statistics.median(pt) if pt else None})
        if (i + 1) % 200 == 0:
            print(f"{i + 1}/{len(schemas)}", file=sys.stderr, flush=True)

    both = [r for r in rows if r["peer"] is not None]
    print(
        f"schemas {len(schemas)}, ours compiled {len(rows)}, both {len(both)} (CPU, median of {args.rounds})"
    )
    print("| engine | p50 | p90 | p95 | p99 | max | sum |")
    print("|---|---|---|---|---|---|---|")
    for name in ("ours", "peer"):
        xs = [r[name] / 1e3 for r in both] if peer is not None else [r["ours"] / 1e3 for r in rows]
        if not xs:
            continue
        q = [_pct(xs, v) for v in (0.5, 0.9, 0.95, 0.99)]
        print(f"| {name} | " + " | ".join(f"{v:.2f}" for v in q) + f" | {max(xs):.1f} | {sum(xs):.0f} |")
        if peer is None:
            break
    if both:
        ours_t = [r["ours"] for r in both]
        peer_t = [r["peer"] for r in both]
        print(
            "ratio peer/ours: "
            + ", ".join(
                f"{n} {_pct(peer_t, q) / _pct(ours_t, q):.2f}"
                for n, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
            )
        )
    print(f"\n| schema | ours ms | {' | '.join(PHASES)} | llguidance ms |")
    print("|---|---|" + "---|" * len(PHASES) + "---|")
    for r in sorted(rows, key=lambda r: -r["ours"])[: args.top]:
        pv = f"{r['peer'] / 1e3:.2f}" if r["peer"] is not None else "-"
        print(
            f"| {r['id']} | {r['ours'] / 1e3:.2f} | "
            + " | ".join(f"{r[k] / 1e3:.2f}" for k in PHASES)
            + f" | {pv} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
