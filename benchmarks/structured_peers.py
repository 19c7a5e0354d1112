"""Peers for ``bench_structured.py``: llama-cpp-python with GBNF from the schema, transformers + XGrammar.

Each peer builds its grammars before timing (as ours compiles before its timed runs) and returns
one :class:`Result` per request. Imported only by the benchmark.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


@dataclass
class Result:
    """One request's outcome: generated text, token count, finish reason and per-request seconds."""

    text: str
    tokens: int
    finish: str
    seconds: float
    decode_seconds: float | None = None  # after the first token, where the engine reports it
    token_ids: list[int] | None = None
    cpu_seconds: float | None = None  # process CPU time, where the request ran alone in this process
    forced_tokens: int | None = None  # output tokens appended by jump-forward (ours only)
    draft_tokens: int | None = None  # speculative draft tokens verified (ours only)
    accepted_draft_tokens: int | None = None


class LlamaCppPeer:
    """llama-cpp-python on the same GGUF; ``LlamaGrammar.from_json_schema`` per schema; greedy.

    Its Python API has no batching, so requests always run one after another: the concurrency-8
    row is the same sequential run (said in the table). llama.cpp can crash the process on some
    converted grammars (deeply nested rules from large ``maxLength``), so requests run in a child
    process that records each request as it starts and ends; after a crash the request that was
    running is reported as ``crash`` and a fresh child continues with the next one. Times are
    measured inside the child per request (process start and model load are not counted).
    """

    name = "llama-cpp-python + GBNF"

    def __init__(self, gguf: Path, threads: int) -> None:
        self.gguf = gguf
        self.threads = threads
        self.errors: dict[str, str] = {}

    def run(self, requests: list[Any], max_tokens: int) -> list[Result | None]:
        """Each request alone; None for schemas that did not convert or crashed llama.cpp."""
        with tempfile.TemporaryDirectory() as tmp:
            spec = Path(tmp) / "requests.json"
            spec.write_text(
                json.dumps(
                    [{"name": r.name, "schema": r.schema, "prompt_ids": r.prompt_ids} for r in requests]
                )
            )
            log = Path(tmp) / "results.jsonl"
            first = 0
            while first < len(requests):
                cmd = [
                    sys.executable,
                    __file__,
                    str(self.gguf),
                    str(self.threads),
                    str(spec),
                    str(max_tokens),
                    str(log),
                    str(first),
                ]
                proc = subprocess.run(
                    cmd, capture_output=True, text=True, timeout=300 * (len(requests) - first)
                )
                done = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
                finished = {d["i"] for d in done if "result" in d or "error" in d}
                started = [d["i"] for d in done if "started" in d and d["i"] not in finished]
                if proc.returncode == 0 or not started:
                    if proc.returncode != 0:
                        raise RuntimeError(f"llama.cpp worker exited {proc.returncode}: {proc.stderr[-500:]}")
                    break
                crashed = started[-1]
                self.errors[requests[crashed].name] = f"crash (exit status {proc.returncode})"
                with log.open("a") as f:
                    f.write(json.dumps({"i": crashed, "error": self.errors[requests[crashed].name]}) + "\n")
                first = crashed + 1
            out: list[Result | None] = [None] * len(requests)
            for d in (json.loads(line) for line in log.read_text().splitlines()):
                if "result" in d:
                    out[d["i"]] = Result(**d["result"])
                elif "error" in d:
                    self.errors.setdefault(requests[d["i"]].name, d["error"])
            return out


def _llama_cpp_worker(gguf: str, threads: int, spec: str, max_tokens: int, log: str, first: int) -> None:
    """Child process body for :class:`LlamaCppPeer`: run requests ``first..`` and log each one."""
    from llama_cpp import Llama, LlamaGrammar

    llm = Llama(model_path=gguf, n_ctx=4096, n_threads=threads, n_threads_batch=threads, verbose=False)
    requests = json.loads(Path(spec).read_text())
    with open(log, "a") as out:
        for i in range(first, len(requests)):
            req = requests[i]
            out.write(json.dumps({"i": i, "started": True}) + "\n")
            out.flush()
            try:
                grammar = LlamaGrammar.from_json_schema(json.dumps(req["schema"]), verbose=False)
            except Exception as exc:  # the converter raises assorted errors on schemas it cannot express
                out.write(json.dumps({"i": i, "error": f"no GBNF: {type(exc).__name__}: {exc}"}) + "\n")
                out.flush()
                continue
            llm.reset()  # no prompt reuse between requests: each pays its prefill
            start = time.perf_counter()
            reply = llm.create_completion(
                req["prompt_ids"], max_tokens=max_tokens, temperature=0.0, grammar=grammar
            )
            seconds = time.perf_counter() - start
            choice = reply["choices"][0]
            result = {"text": choice["text"], "tokens": int(reply["usage"]["completion_tokens"]),
                      "finish": choice.get("finish_reason") or "length", "seconds": seconds}  # fmt: skip
            out.write(json.dumps({"i": i, "result": result}) + "\n")
            out.flush()


class TransformersXGrammarPeer:
    """transformers (float32, dequantized from the same GGUF) + XGrammar's logits processor."""

    name = "transformers + XGrammar"

    def __init__(self, gguf: Path) -> None:
        import xgrammar as xgr
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        self.model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        self.model.eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])
        self.pad = min(self.eos)
        info = xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.model.config.vocab_size, stop_token_ids=sorted(self.eos)
        )
        self.compiler = xgr.GrammarCompiler(info)
        self.grammars: dict[str, Any] = {}
        self.errors: dict[str, str] = {}

    def prepare(self, schemas: dict[str, Any]) -> None:
        """Compile each schema with XGrammar (its defaults: any whitespace, non-strict off)."""
        for name, schema in schemas.items():
            try:
                self.grammars[name] = self.compiler.compile_json_schema(json.dumps(schema))
            except Exception as exc:  # XGrammar raises RuntimeError/ValueError on unsupported schemas
                self.errors[name] = f"{type(exc).__name__}: {exc}"

    def _generate(self, batch: list[Any], max_tokens: int) -> list[Result]:
        from xgrammar.contrib.hf import LogitsProcessor

        width = max(len(r.prompt_ids) for r in batch)
        ids = torch.tensor([[self.pad] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])
        processor = LogitsProcessor([self.grammars[r.name] for r in batch])
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=self.pad,
                logits_processor=[processor],
            )
        seconds = time.perf_counter() - start
        results = []
        for row in out[:, width:].tolist():
            ended = next((i for i, t in enumerate(row) if t in self.eos), None)
            tokens = row if ended is None else row[:ended]
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            results.append(Result(text, len(tokens), "length" if ended is None else "stop", seconds))
        return results

    def run(self, requests: list[Any], max_tokens: int, concurrency: int) -> list[Result | None]:
        """Batches of ``concurrency`` requests, one left-padded ``generate`` each; None where compile failed."""
        runnable = [r for r in requests if r.name in self.grammars]
        done: dict[int, Result] = {}
        for i in range(0, len(runnable), concurrency):
            batch = runnable[i : i + concurrency]
            for req, res in zip(batch, self._generate(batch, max_tokens)):
                done[id(req)] = res
        return [done.get(id(r)) for r in requests]


if __name__ == "__main__":
    # The llama.cpp worker: gguf threads spec max_tokens log first
    _llama_cpp_worker(
        sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
    )
