"""Native lowering alone: the ``CompiledGrammar`` constructor (IR programs -> automata) per schema.

The JSON Schema front end and the serialization run untimed; each schema's programs (kept
native, as ``GrammarCompiler.compile`` passes them to ``compile_serialized``; Python lists where
the extension leaves a grammar to the Python serializer) are then lowered ``--reps`` times and the median process CPU time is kept (the box is shared, and the
CPU clock is what ``bench_grammar.py --clock cpu`` reports too). ``--native PATH`` loads another
build of the extension (e.g. a copy built from the previous commit), so two builds can be
compared back to back on the same programs::

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_lowering.py --limit 200 --seed 0
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_lowering.py --limit 200 --seed 0 \\
        --native /tmp/old_build/_native.cpython-311-x86_64-linux-gnu.so

``--python-programs`` hands both builds the Python serializer's lists instead (the native
serializer's interface may differ between the builds compared; the list conversion is then part
of every timing alike).

Prints the p50 / p90 / p99 / sum of the lowering times over the schemas that compile, their
total automaton states, and the slowest schemas with their state counts.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The engine's defaults (GrammarCompiler): automaton states, compile seconds, Earley items per set.
MAX_STATES, MAX_SECONDS, MAX_ITEMS = 500_000, 30.0, 200_000


def _load_native(path: str | None) -> Any:
    """The extension module: the installed one, or the build at ``path`` in its place."""
    if path is None:
        from agent_infer.native import load_native

        return load_native()
    spec = importlib.util.spec_from_file_location("agent_infer._native", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load an extension module from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["agent_infer._native"] = module  # before agent_infer.grammar imports it
    return module


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def main() -> None:
    """Run the benchmark described in the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "maskbench-dev"))
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--native", default=None, help="path of another build of agent_infer._native")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument(
        "--python-programs", action="store_true", help="lower the Python serializer's lists (any build)"
    )
    args = parser.parse_args()

    native = _load_native(args.native)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_grammar import load_schemas

    from agent_infer.grammar.compile.serialize import serialize_for_compile
    from agent_infer.grammar.ir import Grammar

    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from python_serializer import serialize_grammar_python

    # Lowering does not read the tokenizer: a bare native one.
    tok = native.TokenizerInfo([bytes([b]) for b in range(256)] + [b""], 257, [256])
    rows: list[tuple[str, float, int]] = []
    for item in load_schemas(Path(args.data), args.limit, args.seed):
        try:
            grammar = Grammar.from_json_schema(item["schema"], whitespace="compact")
            if args.python_programs:
                programs, root = serialize_grammar_python(grammar)
            else:
                programs, root = serialize_for_compile(grammar)
        except Exception:  # the front end's compile errors are bench_grammar.py's business
            continue
        make = native.CompiledGrammar if isinstance(programs, list) else native.compile_serialized
        times, states = [], -1
        for rep in range(args.reps):
            if rep and not isinstance(programs, list):
                # compile_serialized consumes its programs: the next rep needs them again (untimed).
                programs, root = serialize_for_compile(grammar)
            start = time.process_time()
            try:
                compiled = make(tok, programs, root, MAX_STATES, MAX_SECONDS, MAX_ITEMS)
                states = int(compiled.num_states)
            except Exception:
                states = -1
            times.append((time.process_time() - start) * 1e3)
        if states >= 0:
            rows.append((item["id"], statistics.median(times), states))
    if not rows:
        raise SystemExit("no schema compiled")
    ms = [r[1] for r in rows]
    print(f"extension: {native.__file__}")
    print(
        f"{len(rows)} schemas, lowering CPU ms (median of {args.reps}): p50 {_pct(ms, 0.5):.3f}  "
        f"p90 {_pct(ms, 0.9):.3f}  p99 {_pct(ms, 0.99):.2f}  sum {sum(ms):.1f};  "
        f"states {sum(r[2] for r in rows)}"
    )
    print("\n| schema | lowering ms | states |\n|---|---|---|")
    for name, t, states in sorted(rows, key=lambda r: -r[1])[: args.top]:
        print(f"| `{name}` | {t:.2f} | {states} |")


if __name__ == "__main__":
    main()
