#!/usr/bin/env python3
"""A time-boxed fuzz campaign over the grammar stack: the generators and the guarded worker of
``tests/grammar/test_fuzz.py``, drawing fresh cases for ``--minutes`` minutes.

Each case (a regex, a JSON Schema or a mutated GBNF/Lark text, checked against ``re``/``jsonschema``/
the reference recognizer, with mask exactness on the real tokenizers) runs in a worker process under
an address-space limit and a per-case timeout; a crash or hang costs one worker restart. Every case
that does not end ``ok`` or in a typed error is written to ``--out`` as ``<status>-NNNN.json``,
which ``python tests/support/fuzz_worker.py FILE`` re-runs in-process. The summary counts cases, crashes,
hangs (and runs past the time limits), blow-ups (MemoryError), wrong masks/acceptance and untyped
exceptions.

    python benchmarks/fuzz_campaign.py --minutes 30 --out fuzz_out
    python benchmarks/fuzz_campaign.py --minutes 5 --kinds regex,schema --tokenizers bytes

Set ``LD_PRELOAD``/``AGENT_INFER_NATIVE_LIBRARY`` as ``make test-asan`` does to fuzz the sanitized
extension (the worker drops its address-space limit under ASan).
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))

from fuzz_cases import CASE_STRATEGIES
from fuzz_harness import FAILURE_KINDS, GuardedWorker, save_reproducer
from hypothesis.errors import NonInteractiveExampleWarning


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, required=True, help="how long to draw new cases")
    parser.add_argument("--out", type=Path, default=Path("fuzz_reproducers"), help="folder for reproducers")
    parser.add_argument("--kinds", default="regex,schema,grammar", help="comma-separated case kinds")
    parser.add_argument("--tokenizers", default="bytes,smollm2,deepseek", help="vocabularies for mask checks")
    parser.add_argument("--seed", type=int, default=None, help="order of kinds (draws are Hypothesis')")
    parser.add_argument("--max-reproducers", type=int, default=200, help="stop writing files after this many")
    args = parser.parse_args()

    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in CASE_STRATEGIES]
    if unknown:
        parser.error(f"unknown kinds {unknown}; choose from {sorted(CASE_STRATEGIES)}")
    tokenizers = tuple(t for t in args.tokenizers.split(",") if t)
    strategies = {k: CASE_STRATEGIES[k](tokenizers) for k in kinds}
    rng = random.Random(args.seed)
    worker = GuardedWorker(tokenizers)
    counts: collections.Counter[str] = collections.Counter()
    per_kind: dict[str, collections.Counter[str]] = {k: collections.Counter() for k in kinds}
    written: list[Path] = []
    deadline = time.monotonic() + 60 * args.minutes
    warnings.simplefilter("ignore", NonInteractiveExampleWarning)
    try:
        while time.monotonic() < deadline:
            kind = rng.choice(kinds)
            case = strategies[kind].example()
            result = worker.run(case)
            status = str(result["status"])
            counts[status] += 1
            per_kind[kind][status] += 1
            if status in FAILURE_KINDS and len(written) < args.max_reproducers:
                path = save_reproducer(args.out, case, result, len(written))
                written.append(path)
                print(f"{status}: {path} ({str(result.get('detail', ''))[:160]!r})", flush=True)
    except KeyboardInterrupt:
        print("interrupted; summary so far", file=sys.stderr)
    finally:
        worker.close()

    total = sum(counts.values())
    print(f"\ncases {total} in {args.minutes:g} min")
    labels = {
        "ok": "passed",
        "typed": "typed errors (fine)",
        "crash": "crashes",
        "hang": "hangs",
        "slow": "past time limits",
        "blowup": "memory blow-ups",
        "wrong": "wrong masks / acceptance",
        "untyped": "untyped exceptions",
    }
    for status, label in labels.items():
        print(f"  {label:28} {counts[status]:7}   " + "  ".join(f"{k}={per_kind[k][status]}" for k in kinds))
    if written:
        print(
            f"reproducers: {len(written)} in {args.out}/ (re-run one: python tests/support/fuzz_worker.py FILE)"
        )
    (args.out / "summary.json").parent.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps({"cases": total, "counts": dict(counts)}, indent=1))
    return 1 if any(counts[s] for s in FAILURE_KINDS) else 0


if __name__ == "__main__":
    sys.exit(main())
