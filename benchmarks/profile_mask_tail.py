"""Where the mask-time tail comes from: bench_grammar.py's decoding of our engine, in process, with
the native mask profile (``agent_infer._native.grammar_profile``) read after every step.

Each step slower than ``--threshold`` µs (process CPU time) is attributed to the profile kind that
took most of its time (a first-visit walk by kind, a key, a run-time check; ``other`` = time no
profiled scope covered: ORing masks, Python). Prints, per kind, the number of such steps, their
share of all mask time, and the schemas that hold most of it.

    python benchmarks/profile_mask_tail.py --tokenizer deepseek --limit 200 --seed 0
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_grammar as bg
from grammar_peers import OursEngine


def main() -> int:
    """Runs the sample and prints the tail breakdown."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bg.add_sample_args(ap)
    ap.add_argument("--threshold", type=float, default=200.0, help="µs (CPU) above which a step is 'tail'")
    ap.add_argument("--top", type=int, default=3, help="schemas listed per kind")
    args = ap.parse_args()

    from agent_infer import _native

    spec = bg.prepare_tokenizer(args.tokenizer)
    schemas = bg.load_schemas(Path(args.data), args.limit, args.seed)
    tokens = bg.tokenize_tests(spec, schemas)
    engine = OursEngine(spec)
    native, view = engine.allocate(1)
    _native.grammar_profile(True)
    all_us = 0.0
    steps = 0
    tail_us: Counter[str] = Counter()
    tail_n: Counter[str] = Counter()
    kind_us: Counter[str] = Counter()  # over all steps
    by_schema: dict[str, Counter[str]] = defaultdict(Counter)
    for s in schemas:
        engine.before_schema()
        try:
            m = engine.compile(s["schema"])
            m.fill(native, 0)
        except Exception:  # compile errors are bench_grammar's business
            continue
        _native.grammar_profile()
        first = True
        for test in tokens[s["id"]]:
            if not test["valid"]:
                continue
            if not first:
                m.reset()
            for pos, tok in enumerate([*test["tokens"], spec.eos_id]):
                if first:
                    first = False
                else:
                    c0 = time.process_time_ns()
                    m.fill(native, 0)
                    us = (time.process_time_ns() - c0) / 1e3
                    prof: dict[str, tuple[int, int]] = _native.grammar_profile()
                    all_us += us
                    steps += 1
                    covered = 0.0
                    for k, (ns, _calls) in prof.items():
                        kind_us[k] += ns / 1e3
                        covered += ns / 1e3
                    kind_us["other"] += max(0.0, us - covered)
                    if us > args.threshold:
                        parts = {k: ns / 1e3 for k, (ns, _c) in prof.items()}
                        parts["other"] = max(0.0, us - covered)
                        top = max(parts, key=lambda k: parts[k])
                        tail_us[top] += us
                        tail_n[top] += 1
                        by_schema[top][s["id"]] += us
                if tok == spec.eos_id and pos == len(test["tokens"]):
                    break
                if not bg._bit(view, 0, tok) or not m.accept(tok):
                    break
    _native.grammar_profile(False)
    n_tail = sum(tail_n.values())
    print(f"{steps} steps, mask time {all_us / 1e3:.1f} ms (CPU), avg {all_us / max(steps, 1):.1f} µs")
    print(
        f"steps > {args.threshold:.0f} µs: {n_tail}, {sum(tail_us.values()) / 1e3:.1f} ms "
        f"({100 * sum(tail_us.values()) / max(all_us, 1):.0f} % of mask time)"
    )
    print("\n| dominant kind | tail steps | their time | % of all mask time | top schemas (ms) |")
    print("|---|---|---|---|---|")
    for k, v in tail_us.most_common():
        tops = ", ".join(f"{sid} {t / 1e3:.1f}" for sid, t in by_schema[k].most_common(args.top))
        print(f"| {k} | {tail_n[k]} | {v / 1e3:.1f} ms | {100 * v / max(all_us, 1):.1f} % | {tops} |")
    print("\n| kind (all steps, exclusive) | time | % |")
    print("|---|---|---|")
    for k, v in kind_us.most_common():
        print(f"| {k} | {v / 1e3:.1f} ms | {100 * v / max(all_us, 1):.1f} % |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
