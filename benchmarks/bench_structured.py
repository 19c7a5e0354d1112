"""Structured generation side by side: the same JSON-Schema workload on every engine, one run.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_structured.py --quick   # ~1-2 min here
    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_structured.py           # the reported run

Workload: ``--schemas`` JSON Schemas drawn with ``--seed`` from ``../shared/data/maskbench-dev``
among those our compiler accepts, whose compact text is at most 1,200 characters, and (with the
default ``--prompts example``) that have a valid test instance of at most 400 characters. Each
prompt is the chat template around what a real request carries, as in the engine's MaskBench test:
the description, the field names and that instance as an example (``--prompts schema``: the
description and the whole schema text instead); see ``structured_workload.py``. Greedy decoding,
fixed ``--max-tokens``, default model (the SmolLM2-135M-Instruct GGUF), 2 CPU threads for every
engine, prefix caching off. Grammars are compiled before the timed runs by every engine (ours: an
untimed warm-up pass).

Rows: ours unconstrained (natural EOS, and length-matched: ``ignore_eos`` with each request's token
count from the constrained forced-off run, so both rows decode exactly the same number of tokens);
ours constrained with overlap (async scheduling) on/off x forced tokens on/off, and forced on
without boundary drafts (jump-forward alone: the forced text's last tokens are sampled rather than
verified as a draft), and forced on with the full output projection (``masked_head=False``: the
head computes every token's logit, also those the grammar excludes);
llama-cpp-python with ``LlamaGrammar.from_json_schema`` (no batched API: requests run one after
another, so its concurrency-8 column is the sequential run); transformers + XGrammar's
``LogitsProcessor`` (one left-padded batched ``generate`` per 8 requests). Concurrency 1: requests
one at a time; concurrency 8: ours submits 8 requests to one ``generate`` call.

Order: concurrency-8 rows run one after another; at concurrency 1 each request runs on every one of
our configurations back to back (the order rotated per request) and then its two unconstrained
references, so load from other processes hits the paired runs alike.

Metrics: tokens/s = generated tokens / wall time of the whole row; wall per request = mean
per-request latency; CPU s per request = process CPU time (concurrency 1 only; the trustworthy clock
on a shared machine); % valid = outputs that parse and validate against their schema (jsonschema),
finish ``stop``. Forced-token metric: wall time per JSON object with forced tokens on, versus
generating the same number of tokens unconstrained (``ignore_eos``, ``max_tokens`` = the object's
token count), both at concurrency 1, as a ratio of means (total and after the first token), of CPU
times, and as the median of per-request ratios; plus the share of output tokens that were forced.
With the engine's defaults on both sides (prompt-lookup drafts), the reference must decode the same
text, since drafts depend on it: the forced-on draft row's text is replayed through a one-choice
constraint with forced tokens off and the same drafts (the model decodes that text token by token,
as if it had chosen it; only the masks differ from unconstrained decoding).
We time decoding rather than a prefill of the text, because decoding token by token is what
producing the object costs without jump-forward; a prefill would be a lower bound no sampler
reaches. With ``--repeats N`` our rows run N passes: a row's wall time (and tokens/s) is its median
pass, each request's times are its medians over the passes. Peers run once.
Results: a markdown table on stdout, raw JSON in ``bench_results/structured-<UTC>.json``.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

# benchmarks/ is on sys.path when this file runs as a script
from structured_peers import LlamaCppPeer, Result, TransformersXGrammarPeer
from structured_workload import Request, pick_workload, validate

THREADS = 2
PLAIN = "ours unconstrained"
FORCED_ON = "ours constrained, overlap on, forced on"
FORCED_OFF = "ours constrained, overlap on, forced off"
REF_OFF = "ours unconstrained, length-matched"
REF_ON = "ours unconstrained, same tokens as forced on"
DRAFTS_ON = "ours constrained, overlap on, forced on, drafts"
NO_BOUNDARY = "ours constrained, overlap on, forced on, no boundary drafts"
FULL_HEAD = "ours constrained, overlap on, forced on, full head"
PLAIN_DRAFTS = "ours unconstrained, drafts"
REF_DRAFTS = "ours unconstrained, same tokens as forced on + drafts"
REPLAY_DRAFTS = "ours replay of the same text, drafts (forced off)"
UNCONSTRAINED = (PLAIN, PLAIN_DRAFTS)
ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "maskbench-dev"


class Ours:
    """agent-infer's engine with given options, on weights shared by every row."""

    #: JSON layout our grammars allow ("flexible": bounded optional whitespace, the default;
    #: "compact": none, so keys and punctuation become forced tokens). Set from --whitespace.
    whitespace = "flexible"

    def __init__(self, loaded: Any, **options: Any) -> None:
        from agent_infer.engine.config import EngineConfig
        from agent_infer.engine.llm_engine import LLMEngine
        from agent_infer.llm import LLM

        known = {f.name for f in dataclasses.fields(EngineConfig)}
        missing = [k for k in options if k not in known]
        if missing:
            raise RuntimeError(f"EngineConfig has no option {', '.join(missing)} (engine not updated)")
        # Speculative decoding is on by default; rows without "drafts" in their name decode plainly.
        options.setdefault("speculative_tokens", 0)
        config = EngineConfig.from_kwargs(enable_prefix_caching=False, **options)
        self.llm = LLM.from_engine(LLMEngine(config=config, loaded=loaded))

    def replay(self, req: Request, text: str) -> Result:
        """Decode exactly ``text`` after ``req``'s prompt, token by token as the model would if it
        chose that text itself (a one-choice constraint; with forced tokens off nothing is appended
        without a forward pass), with the process CPU time; its literal grammar is compiled untimed."""
        from agent_infer import SamplingParams
        from agent_infer.structured import StructuredOutput

        params = SamplingParams(
            temperature=0.0, max_tokens=4 * len(text) + 8, structured=StructuredOutput.choice([text])
        )
        self.llm.generate([req.prompt_ids[:3]], [dataclasses.replace(params, max_tokens=1)])
        cpu = time.process_time()
        out = self.llm.generate([req.prompt_ids], [params])[0]
        c, m = out.outputs[0], out.metrics
        return Result(
            c.text,
            len(c.token_ids),
            c.finish_reason or "?",
            (m.finished_time or 0.0) - m.arrival_time,
            None if m.first_token_time is None else (m.finished_time or 0.0) - m.first_token_time,
            c.token_ids,
            cpu_seconds=time.process_time() - cpu,
            draft_tokens=m.num_draft_tokens,
            accepted_draft_tokens=m.num_accepted_draft_tokens,
        )

    def run(
        self,
        requests: list[Request],
        max_tokens: list[int],
        structured: bool,
        concurrency: int,
        ignore_eos: bool = False,
    ) -> list[Result]:
        """Groups of ``concurrency`` requests per ``generate`` call; per-request times from engine metrics."""
        from agent_infer import SamplingParams
        from agent_infer.structured import StructuredOutput

        results: list[Result] = []
        for i in range(0, len(requests), concurrency):
            group = requests[i : i + concurrency]
            params = [
                SamplingParams(
                    temperature=0.0,
                    max_tokens=m,
                    ignore_eos=ignore_eos,
                    structured=(
                        StructuredOutput.json_schema(r.schema, whitespace=self.whitespace)
                        if structured
                        else None
                    ),
                )
                for r, m in zip(group, max_tokens[i : i + concurrency])
            ]
            outs = self.llm.generate([r.prompt_ids for r in group], params)
            for out in outs:
                c, m = out.outputs[0], out.metrics
                total = (m.finished_time or 0.0) - m.arrival_time
                decode = None if m.first_token_time is None else (m.finished_time or 0.0) - m.first_token_time
                results.append(
                    Result(
                        c.text,
                        len(c.token_ids),
                        c.finish_reason or "?",
                        total,
                        decode,
                        c.token_ids,
                        forced_tokens=m.num_forced_tokens,
                        draft_tokens=m.num_draft_tokens,
                        accepted_draft_tokens=m.num_accepted_draft_tokens,
                    )
                )
        return results


def summarise(
    label: str,
    conc: int,
    requests: list[Request],
    results: list[Result | None],
    wall: float,
    note: str = "",
    check: bool = True,
) -> dict[str, Any]:
    """One table row (plus raw per-request results) from a timed run."""
    ran = [(r, res) for r, res in zip(requests, results) if res is not None]
    errors = [validate(res.text, r.schema) if check else None for r, res in ran]
    valid = sum(e is None and res.finish == "stop" for e, (_, res) in zip(errors, ran)) if check else None
    tokens = sum(res.tokens for _, res in ran)
    cpus = [res.cpu_seconds for _, res in ran if res.cpu_seconds is not None]
    forced = [res.forced_tokens for _, res in ran if res.forced_tokens is not None and check]
    return {
        "row": label, "concurrency": conc, "requests": len(ran), "skipped": len(requests) - len(ran),
        "tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall if wall else 0.0,
        "per_request_s": statistics.mean(res.seconds for _, res in ran) if ran else None,
        "per_request_decode_s": statistics.mean(res.decode_seconds for _, res in ran if res.decode_seconds is not None)
        if any(res.decode_seconds is not None for _, res in ran) else None,
        "per_request_cpu_s": statistics.mean(cpus) if cpus else None,
        "forced_share": sum(forced) / tokens if forced and tokens else None,
        "drafted": sum(res.draft_tokens or 0 for _, res in ran),
        "accepted": sum(res.accepted_draft_tokens or 0 for _, res in ran),
        # Our forward passes (each samples one token; forced and accepted draft tokens ride along).
        "passes": sum(res.tokens - (res.forced_tokens or 0) - (res.accepted_draft_tokens or 0) for _, res in ran),
        "valid_pct": None if valid is None or not requests else 100.0 * valid / len(requests),
        "finish": {f: sum(res.finish == f for _, res in ran) for f in sorted({res.finish for _, res in ran})},
        "note": note,
        "results": [{"schema": r.name, "text": res.text, "tokens": res.tokens, "finish": res.finish,
                     "seconds": res.seconds, "decode_seconds": res.decode_seconds, "cpu_seconds": res.cpu_seconds,
                     "forced_tokens": res.forced_tokens, "error": e} for (r, res), e in zip(ran, errors)],
    }  # fmt: skip


def timed(fn: Any) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def solo_run(eng: Ours, req: Request, max_tokens: int, structured: bool, ignore_eos: bool = False) -> Result:
    """One request alone, with the process CPU time it took (the engine runs in this process)."""
    cpu = time.process_time()
    [res] = eng.run([req], [max_tokens], structured, 1, ignore_eos)
    return dataclasses.replace(res, cpu_seconds=time.process_time() - cpu)


def median_results(passes: list[list[Result]]) -> list[Result]:
    """Per request: the last pass's outcome with the median of each of its times over all passes."""

    def med(xs: list[float | None]) -> float | None:
        vals = [x for x in xs if x is not None]
        return statistics.median(vals) if vals else None

    return [
        dataclasses.replace(
            same[-1],
            seconds=statistics.median(r.seconds for r in same),
            decode_seconds=med([r.decode_seconds for r in same]),
            cpu_seconds=med([r.cpu_seconds for r in same]),
        )
        for same in zip(*passes)
    ]


def main(argv: list[str] | None = None) -> int:
    """Run every row, print the table and the targets, save JSON."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--schemas", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument(
        "--conc1-requests", type=int, default=None, help="requests in concurrency-1 rows (default all)"
    )
    parser.add_argument("--repeats", type=int, default=1, help="timed passes over our rows (median wall)")
    parser.add_argument(
        "--quick", action="store_true", help="8 schemas, 64 tokens, overlap on only, no transformers"
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        choices=["llama_cpp", "transformers", "overlap_off", "boundary_off", "full_head"],
    )
    parser.add_argument(
        "--peer-requests", type=int, default=None, help="requests llama.cpp runs (default all)"
    )
    parser.add_argument(
        "--whitespace",
        choices=("flexible", "compact"),
        default="flexible",
        help="JSON layout of our constrained rows (peers keep their own defaults)",
    )
    parser.add_argument(
        "--prompts",
        choices=("example", "schema"),
        default="example",
        help="prompt style (see structured_workload.py): description + fields + example, or + schema text",
    )
    parser.add_argument(
        "--drafts",
        type=int,
        default=5,
        help="speculative_tokens of the draft rows (prompt-lookup speculative decoding); 0 skips them",
    )
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    Ours.whitespace = args.whitespace
    if args.quick:
        args.schemas, args.max_tokens = 8, 64
        args.conc1_requests = args.conc1_requests or 1
        args.peer_requests = args.peer_requests or 4
        args.skip = sorted({*args.skip, "transformers", "overlap_off", "boundary_off", "full_head"})
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    args.out = args.out or ROOT / "bench_results" / f"structured-{stamp}.json"
    torch.set_num_threads(THREADS)
    os.environ["AGENT_INFER_NUM_THREADS"] = str(THREADS)
    from agent_infer.model.loader import load_model

    loaded = load_model()
    requests = pick_workload(loaded, args.schemas, args.seed, args.data, args.prompts)
    print(f"workload: {len(requests)} schemas: {', '.join(r.name for r in requests)}", file=sys.stderr)
    solo = requests[: args.conc1_requests or len(requests)]
    cap = [args.max_tokens] * len(requests)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []

    def add(row: dict[str, Any]) -> None:
        rows.append(row)
        print(
            f"  {row['row']} c={row['concurrency']}: {row['tok_per_s']:.1f} tok/s, valid {row['valid_pct']}",
            file=sys.stderr,
        )

    configs = {
        "ours constrained, overlap on, forced on": {"async_scheduling": True, "forced_tokens": True},
        "ours constrained, overlap on, forced off": {"async_scheduling": True, "forced_tokens": False},
        "ours constrained, overlap off, forced on": {"async_scheduling": False, "forced_tokens": True},
        "ours constrained, overlap off, forced off": {"async_scheduling": False, "forced_tokens": False},
    }
    if "boundary_off" not in args.skip:
        configs[NO_BOUNDARY] = {"async_scheduling": True, "forced_tokens": True, "boundary_drafts": False}
    if "full_head" not in args.skip:
        configs[FULL_HEAD] = {"async_scheduling": True, "forced_tokens": True, "masked_head": False}
    if args.drafts:
        configs[DRAFTS_ON] = {
            "async_scheduling": True,
            "forced_tokens": True,
            "speculative_tokens": args.drafts,
        }
    notes.append(f"our JSON whitespace: {args.whitespace} (peers: their defaults)")
    if "overlap_off" in args.skip:
        configs = {k: v for k, v in configs.items() if "overlap on" in k}
        notes.append("overlap-off rows skipped (--quick or --skip overlap_off)")
    engines: dict[str, Ours] = {}
    for label, options in configs.items():
        try:
            engines[label] = Ours(loaded, **options)
            # Warm-up: compiles every grammar into the engine's cache; 3-token prompts keep prefill cheap.
            stubs = [dataclasses.replace(r, prompt_ids=r.prompt_ids[:3]) for r in requests]
            engines[label].run(stubs, [1] * len(stubs), True, 8)
        except Exception as exc:
            notes.append(f"{label}: not run ({type(exc).__name__}: {exc})")
    plain = Ours(loaded)
    plains = {PLAIN: plain}
    # The engine's defaults on the reference side too: prompt-lookup drafts, no grammar of its own.
    replayer = Ours(loaded, forced_tokens=False, speculative_tokens=args.drafts) if args.drafts else None
    if args.drafts:
        plains[PLAIN_DRAFTS] = Ours(loaded, speculative_tokens=args.drafts)
    passes: dict[tuple[str, int], list[list[Result]]] = {}
    walls: dict[tuple[str, int], list[float]] = {}
    meta: dict[tuple[str, int], tuple[list[Request], str, bool]] = {
        (REF_OFF, c): (reqs, "same token counts as forced off", False)
        for c, reqs in ((8, requests), (1, solo))
    }
    meta[(REF_ON, 1)] = (solo, "forced-token metric reference", False)
    meta[(REF_DRAFTS, 1)] = (solo, "forced-token metric reference for the draft row", False)
    meta[(REPLAY_DRAFTS, 1)] = (solo, "reference with the same drafts for the draft row", False)

    def record(label: str, conc: int, res: list[Result], wall: float) -> None:
        passes.setdefault((label, conc), []).append(res)
        walls.setdefault((label, conc), []).append(wall)
        meta.setdefault((label, conc), (requests if conc == 8 else solo, "", label not in UNCONSTRAINED))
        print(f"  {label} c={conc}: {wall:.1f} s", file=sys.stderr)

    # Greedy decoding is deterministic, so every repeat produces the same tokens and only the times
    # vary. Concurrency 8: rows interleaved within each repeat. Concurrency 1: requests interleaved,
    # each one run on every configuration back to back (order rotated per request) and its
    # unconstrained references right after, so load from other processes hits paired runs alike.
    for rep in range(args.repeats):
        for label, eng in (*plains.items(), *engines.items()):
            res, wall = timed(lambda e=eng, s=label not in UNCONSTRAINED: e.run(requests, cap, s, 8))
            record(label, 8, res, wall)
        if FORCED_OFF in engines:
            n = [max(1, x.tokens) for x in passes[(FORCED_OFF, 8)][-1]]
            res, wall = timed(lambda n=n: plain.run(requests, n, False, 8, ignore_eos=True))
            record(REF_OFF, 8, res, wall)
        got: dict[str, list[Result]] = {}
        for i, req in enumerate(solo):
            labels = [*plains, *engines]
            k = (i + rep) % len(labels)
            one: dict[str, Result] = {}
            for label in labels[k:] + labels[:k]:
                eng = plains[label] if label in plains else engines[label]
                one[label] = solo_run(eng, req, args.max_tokens, label not in UNCONSTRAINED)
            refs = ((REF_OFF, FORCED_OFF), (REF_ON, FORCED_ON), (REF_DRAFTS, DRAFTS_ON))
            for ref, src in refs[:: 1 if (i + rep) % 2 else -1]:
                if src in one:
                    one[ref] = solo_run(plain, req, max(1, one[src].tokens), False, ignore_eos=True)
            if replayer is not None and DRAFTS_ON in one:
                one[REPLAY_DRAFTS] = replayer.replay(req, one[DRAFTS_ON].text)
            for label, res1 in one.items():
                got.setdefault(label, []).append(res1)
        for label, res in got.items():
            record(label, 1, res, sum(r.seconds for r in res))
    for key, samples in walls.items():
        reqs, note, check = meta[key]
        note = f"{note}; median of {len(samples)}" if len(samples) > 1 else note
        merged = median_results(passes[key])
        add(
            summarise(
                key[0], key[1], reqs, list(merged), statistics.median(samples), note.lstrip("; "), check
            )
        )

    save(rows, notes, args)  # a peer that brings the process down must not take our rows with it
    gguf = Path(loaded.path)
    schemas = {r.name: r.schema for r in requests}
    if "llama_cpp" not in args.skip:
        try:
            peer = LlamaCppPeer(gguf, THREADS)
            peer_reqs = requests[: args.peer_requests or len(requests)]
            res = peer.run(peer_reqs, args.max_tokens)
            wall = sum(r.seconds for r in res if r is not None)  # per-request times, child start excluded
            problems = "; ".join(f"{k}: {v[:80]}" for k, v in peer.errors.items())
            note = "sequential (no batched API); " + (
                f"not run: {problems}" if problems else "all schemas ran"
            )
            add(summarise(peer.name, 1, peer_reqs, res, wall, note))
            rows.append({**rows[-1], "concurrency": 8, "note": note + "; same run as concurrency 1"})
        except Exception as exc:
            notes.append(f"llama-cpp-python: not run ({type(exc).__name__}: {exc})")
    if "transformers" not in args.skip:
        try:
            hf = TransformersXGrammarPeer(gguf)
            hf.prepare(schemas)
            note = f"{len(hf.errors)} schemas did not compile" if hf.errors else "left-padded batch"
            for conc, reqs in ((8, requests), (1, solo)):
                res, wall = timed(lambda reqs=reqs, conc=conc: hf.run(reqs, args.max_tokens, conc))
                add(summarise(hf.name, conc, reqs, res, wall, note))
        except Exception as exc:
            notes.append(f"transformers + XGrammar: not run ({type(exc).__name__}: {exc})")
    else:
        notes.append("transformers + XGrammar: skipped (--quick or --skip transformers)")
    save(rows, notes, args)
    report(rows, notes, args, requests, loaded)
    return 0


def save(rows: list[dict[str, Any]], notes: list[str], args: Any) -> None:
    """Write everything measured so far to ``args.out`` (JSON)."""
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "notes": notes}
    args.out.write_text(json.dumps(payload, indent=1))


def _activations(loaded: Any) -> str:
    """Which linear path the model runs: native int8 or float32 activations, or torch matmuls."""
    if not loaded.model.native:
        return "torch fp32"
    return "native int8 (q8)" if loaded.model.lm_head.packed.q8_activations else "native fp32"


def report(
    rows: list[dict[str, Any]], notes: list[str], args: Any, requests: list[Request], loaded: Any
) -> None:
    """Print the markdown table and the issue's targets; save everything as JSON."""
    print(
        f"\n{len(requests)} MaskBench schemas (seed {args.seed}), greedy, max_tokens {args.max_tokens}, "
        f"{THREADS} threads, model {Path(loaded.path).name}, torch {torch.__version__}, "
        f"linear activations {_activations(loaded)}\n"
    )
    print(
        "| engine / setting | conc | requests | tokens | wall s | tokens/s | s per request | CPU s per request "
        "| % valid | finish | note |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: -r["concurrency"]):
        valid = "-" if r["valid_pct"] is None else f"{r['valid_pct']:.0f}"
        per = "-" if r["per_request_s"] is None else f"{r['per_request_s']:.2f}"
        cpu = "-" if r.get("per_request_cpu_s") is None else f"{r['per_request_cpu_s']:.2f}"
        finish = ", ".join(f"{k} {v}" for k, v in r["finish"].items())
        print(f"| {r['row']} | {r['concurrency']} | {r['requests']} | {r['tokens']} | {r['wall_s']:.1f} | "
              f"{r['tok_per_s']:.1f} | {per} | {cpu} | {valid} | {finish} | {r['note']} |")  # fmt: skip
    by = {(r["row"], r["concurrency"]): r for r in rows}

    def ratio(a: tuple[str, int], b: tuple[str, int], key: str) -> str:
        x, y = by.get(a), by.get(b)
        if not x or not y or not x.get(key) or not y.get(key):
            return "n/a"
        return f"{x[key] / y[key]:.2f}"

    def paired(a: tuple[str, int], b: tuple[str, int], key: str) -> str:
        """Median over requests of the per-request ratio (requests ran back to back)."""
        x, y = by.get(a), by.get(b)
        if not x or not y:
            return "n/a"
        pairs = [(p[key], q[key]) for p, q in zip(x["results"], y["results"]) if p.get(key) and q.get(key)]
        return f"{statistics.median(p / q for p, q in pairs):.2f}" if pairs else "n/a"

    print("\nTargets (issue 5):")
    for conc in (8, 1):
        print(f"* constrained (overlap on, forced off) / unconstrained length-matched tokens/s, conc {conc}: "
              f"{ratio((FORCED_OFF, conc), (REF_OFF, conc), 'tok_per_s')} (target >= 0.97)")  # fmt: skip
    on, ref = (FORCED_ON, 1), (REF_ON, 1)
    share = by.get(on, {}).get("forced_share")
    print(f"* wall per JSON object, forced on / unconstrained same tokens, conc 1 (target <= 0.7): "
          f"{ratio(on, ref, 'per_request_s')} total, {ratio(on, ref, 'per_request_decode_s')} after the first "
          f"token; CPU time {ratio(on, ref, 'per_request_cpu_s')}; median per-request ratio: wall "
          f"{paired(on, ref, 'seconds')}, CPU {paired(on, ref, 'cpu_seconds')}; forced tokens "
          f"{'n/a' if share is None else f'{100 * share:.0f}%'} of the output; forward passes "
          f"{by.get(on, {}).get('passes', 'n/a')} for {by.get(on, {}).get('tokens', 'n/a')} tokens")  # fmt: skip
    if (NO_BOUNDARY, 1) in by:
        nb = (NO_BOUNDARY, 1)
        print(f"* same, forced on without boundary drafts (jump-forward alone): {ratio(nb, ref, 'per_request_s')} "
              f"total; CPU time {ratio(nb, ref, 'per_request_cpu_s')}; median per-request ratio: wall "
              f"{paired(nb, ref, 'seconds')}; boundary drafts accepted in the forced-on row "
              f"{by[on]['accepted']}/{by[on]['drafted']}")  # fmt: skip
    if (FULL_HEAD, 1) in by:
        fh = (FULL_HEAD, 1)
        print(f"* same, forced on with the full output projection (no masked head): "
              f"{ratio(fh, ref, 'per_request_s')} total; CPU time {ratio(fh, ref, 'per_request_cpu_s')}; masked / "
              f"full head wall per request: {ratio(on, fh, 'per_request_s')} (median per request "
              f"{paired(on, fh, 'seconds')})")  # fmt: skip
    on, ref = (DRAFTS_ON, 1), (REF_DRAFTS, 1)
    if on in by:
        row = by[on]
        print(f"* same, forced on + prompt-lookup drafts ({args.drafts}): {ratio(on, ref, 'per_request_s')} total, "
              f"{ratio(on, ref, 'per_request_decode_s')} after the first token; CPU time "
              f"{ratio(on, ref, 'per_request_cpu_s')}; median per-request ratio: wall {paired(on, ref, 'seconds')}; "
              f"drafts accepted {row['accepted']}/{row['drafted']}")  # fmt: skip
        if (REPLAY_DRAFTS, 1) in by:
            rp = (REPLAY_DRAFTS, 1)
            print(f"* engine defaults on both sides: forced on + drafts / the same text replayed with the same "
                  f"drafts (forced off): {ratio(on, rp, 'per_request_s')} total, CPU time "
                  f"{ratio(on, rp, 'per_request_cpu_s')}; median per-request ratio: wall {paired(on, rp, 'seconds')}; "
                  f"replay drafts accepted {by[rp]['accepted']}/{by[rp]['drafted']}")  # fmt: skip
        for conc in (8, 1):
            print(f"* speculation alone, unconstrained with / without drafts, wall per request, conc {conc}: "
                  f"{ratio((PLAIN_DRAFTS, conc), (PLAIN, conc), 'per_request_s')}; constrained forced on "
                  f"with / without drafts: {ratio((DRAFTS_ON, conc), (FORCED_ON, conc), 'per_request_s')}")  # fmt: skip
    print(f"* ours constrained (overlap on, forced on) / llama.cpp constrained tokens/s at 8 concurrent: "
          f"{ratio((FORCED_ON, 8), ('llama-cpp-python + GBNF', 8), 'tok_per_s')} (target >= 2)")  # fmt: skip
    for note in notes:
        print(f"* {note}")
    print(f"\nraw results: {args.out}")


if __name__ == "__main__":
    sys.exit(main())
