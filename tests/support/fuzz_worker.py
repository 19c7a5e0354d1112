"""The checking side of the grammar fuzz suite: one case in, one verdict out.

A *case* is a JSON object (so it can cross a pipe and be saved as a reproducer):

* ``{"kind": "regex", "pattern", "matching", "candidates", "tokenizer", "seed"}``: the matcher
  accepts every ``matching`` string (drawn by Hypothesis' ``from_regex``) and, of the candidates,
  strings the grammar generates and byte mutations of them, exactly those ``re.fullmatch``
  accepts (UTF-8 that does not decode is rejected);
* ``{"kind": "schema", "schema", "instances", "tokenizer", "seed"}``: nothing the matcher accepts
  is invalid JSON or invalid for ``jsonschema``; valid instances the documented policies do not
  exclude (no objects, canonical numbers) are accepted;
* ``{"kind": "grammar", "syntax", "text", "tokenizer", "seed"}``: the text compiles or raises a
  typed error; if it compiles, the native matcher agrees with the reference recognizer;
* ``{"kind": "stress", "front", "source", "options", "tokenizer", "seed"}``: a regex, GBNF, Lark
  or schema past the usual sizes (deep nesting, huge repeats, extreme keyword values): compiled
  within the limits or a typed error, then generated strings decoded (no reference at that size).

Every case also checks mask exactness on ``tokenizer`` along one accepted string (the mask equals
what ``accept_token`` accepts, the oracle of ``grammar_support``). Verdict ``status``:
``ok``, ``typed`` (an ``AgentInferError`` on bad input: fine), ``untyped``, ``wrong``, ``blowup``
(``MemoryError``), ``slow`` (past the time limits with no ``GrammarLimitError``); the parent
(:mod:`fuzz_harness`) adds ``crash`` and ``hang`` for a worker that dies or stops answering.

``python tests/support/fuzz_worker.py CASE.json`` re-runs a saved case in this process (a reproducer).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import sys
import time
import traceback
from typing import Any

from fuzz_oracles import (
    MAX_REFERENCE_SIZE,
    DuplicateKey,
    OutOfBudget,
    budget,
    ecma_validator,
    expanded_size,
    mutations,
    no_duplicates,
    policy_free,
)

# The compiler limits every case runs under: small enough that a runaway case stops in seconds.
MAX_COMPILE_SECONDS = 5.0
MAX_STATES = 100_000
MASK_POSITIONS = 4  # mask-exactness checks per case, spread over one accepted string
MAX_CANDIDATE_BYTES = 200  # generated strings are cut here (a cut may split a character: still a case)
MAX_REGEX_REFERENCE_CHARS = 16  # longer non-members are not checked against re (backtracking)
MAX_REFERENCE_BYTES = 60  # the reference recognizer is a Python Earley parser, cubic at worst
GENERATE_SECONDS = 2.0  # time budget of the IR string generator per case


class _Checker:
    """Runs cases; tokenizers and the support helpers load once per process."""

    def __init__(self) -> None:
        import grammar_support as support

        from agent_infer import errors
        from agent_infer.grammar import Grammar, GrammarCompiler, GrammarMatcher

        self.support = support
        self.errors = errors
        self.Grammar = Grammar
        self.GrammarCompiler = GrammarCompiler
        self.GrammarMatcher = GrammarMatcher
        self._byte_tokens: dict[int, dict[bytes, int]] = {}

    def warm(self, tokenizers: list[str]) -> None:
        for name in tokenizers:
            self.support.tokenizer_info(name)

    def compile(self, grammar: Any, tokenizer: str) -> Any:
        info = self.support.tokenizer_info(tokenizer)
        compiler = self.GrammarCompiler(
            info, cache_enabled=False, max_states=MAX_STATES, max_compile_seconds=MAX_COMPILE_SECONDS
        )
        start = time.monotonic()
        compiled = compiler.compile(grammar)
        elapsed = time.monotonic() - start
        if elapsed > 2 * MAX_COMPILE_SECONDS + 1:
            raise _Slow(f"compile took {elapsed:.1f} s, limit {MAX_COMPILE_SECONDS} s, no GrammarLimitError")
        return compiled

    def byte_accepts(self, compiled: Any, data: bytes) -> bool:
        """Whole-string acceptance over the bytes-only vocabulary: one token per byte, then EOS."""
        m = self.GrammarMatcher(compiled)
        return all(m.accept_token(b) for b in data) and bool(m.accept_token(256))

    def check_mask_path(self, compiled: Any, text: str, rng: random.Random) -> str | None:
        """Mask exactness at up to MASK_POSITIONS token positions while decoding ``text``."""
        info = compiled.tokenizer_info
        ids = self.faithful_ids(info, text)
        m = self.GrammarMatcher(compiled)
        picks = set(rng.sample(range(len(ids) + 1), min(MASK_POSITIONS, len(ids) + 1)))
        for pos in range(len(ids) + 1):
            if pos in picks:
                bits = self.support.mask_bits(m, info.vocab_size)
                try:
                    self.support.assert_bits_match_acceptance(m, bits, pos)
                except AssertionError as exc:
                    return f"mask differs from accept_token decoding {text!r} as {ids}: {exc}"
            if pos < len(ids) and not m.accept_token(ids[pos]):
                return f"token {pos} ({ids[pos]}) of accepted text {text!r} rejected (ids {ids})"
        spelled = b"".join(info.token_bytes(t) for t in ids)
        if spelled == text.encode("utf-8", "surrogatepass") and not m.can_terminate():
            return f"accepted text {text!r} decoded as tokens {ids} cannot terminate"
        return None

    def faithful_ids(self, info: Any, text: str) -> list[int]:
        """Token ids spelling ``text`` byte for byte: the canonical encoding when it is faithful, else
        character by character (single-byte tokens where a character's encoding is not), cut before
        the first character the vocabulary cannot spell (some GGUF vocabularies lack byte tokens)."""
        ids = info.encode(text)
        if b"".join(info.token_bytes(t) for t in ids) == text.encode("utf-8", "surrogatepass"):
            return list(ids)
        key = id(info)
        if key not in self._byte_tokens:
            self._byte_tokens[key] = {
                info.token_bytes(t): t for t in range(info.vocab_size) if len(info.token_bytes(t)) == 1
            }
        singles = self._byte_tokens[key]
        ids = []
        for ch in text:
            data = ch.encode("utf-8", "surrogatepass")
            piece = info.encode(ch)
            if b"".join(info.token_bytes(t) for t in piece) != data:
                if not all(bytes([b]) in singles for b in data):
                    break
                piece = [singles[bytes([b])] for b in data]
            ids.extend(piece)
        return ids

    def generated(self, grammar: Any, rng: random.Random, n: int) -> list[bytes]:
        """Up to ``n`` strings of the grammar's IR. The generator is a test helper, not the subject:
        it writes every copy of a counted repeat and recurses per nesting level, so it gets
        GENERATE_SECONDS and Python's recursion limit, and yields nothing past them."""
        from agent_infer.testing import random_strings

        try:
            with budget(GENERATE_SECONDS):
                texts = random_strings(grammar, n, rng.randrange(1 << 30), max_repeat=3, max_depth=4)
        except (OutOfBudget, RecursionError):
            return []
        return [t.encode("utf-8", "surrogatepass")[:MAX_CANDIDATE_BYTES] for t in texts]

    # --- the three kinds -------------------------------------------------------------------------

    def run(self, case: dict[str, Any]) -> str | None:
        """None when every property holds, else what went wrong (a ``wrong`` verdict)."""
        rng = random.Random(case.get("seed", 0))
        kind = case["kind"]
        if kind == "probe":
            return _probe(case["action"])
        if kind == "stress":
            return self._run_stress(case, rng)
        if kind == "regex":
            grammar = self.Grammar.from_regex(case["pattern"])
            regex = re.compile(case["pattern"])
            matching = {c.encode("utf-8", "surrogatepass") for c in case.get("matching", [])}

            def reference(data: bytes) -> bool | None:
                if data in matching:
                    return True
                try:
                    text = data.decode("utf-8")
                except UnicodeDecodeError:
                    return False
                # re backtracks: nested repeats take exponential time on long near misses.
                return regex.fullmatch(text) is not None if len(text) <= MAX_REGEX_REFERENCE_CHARS else None

            seeds = sorted(matching) + [c.encode("utf-8", "surrogatepass") for c in case["candidates"]]
        elif kind == "schema":
            grammar = self.Grammar.from_json_schema(case["schema"], whitespace="compact")
            return self._run_schema(case, grammar, rng)
        elif kind == "grammar":
            grammar = self.Grammar.from_ebnf(case["text"], syntax=case["syntax"])
            from agent_infer.grammar.ir.recognizer import ReferenceRecognizer

            # The reference unrolls counted repeats into productions: past a size it is skipped.
            small = expanded_size(grammar) <= MAX_REFERENCE_SIZE
            recognizer = ReferenceRecognizer(grammar) if small else None

            def reference(data: bytes) -> bool | None:
                if recognizer is None:
                    return None
                try:
                    return bool(recognizer.accepts(data.decode("utf-8")))
                except UnicodeDecodeError:
                    return False

            seeds = []
        else:
            raise ValueError(f"unknown case kind {kind!r}")
        compiled = self.compile(grammar, "bytes")
        pool = seeds + self.generated(grammar, rng, 3)
        pool += mutations(rng.choice(pool) if pool else b"", rng, 6)
        if kind == "grammar":
            pool = [data[:MAX_REFERENCE_BYTES] for data in pool]
        accepted = []
        for data in pool:
            want, got = reference(data), self.byte_accepts(compiled, data)
            if want is None:
                continue
            if want != got:
                return f"matcher {'accepts' if got else 'rejects'} {data!r}; the reference does not agree"
            if want:
                accepted.append(data.decode("utf-8"))
        return self._mask_check(case, grammar, accepted, rng)

    def _run_schema(self, case: dict[str, Any], grammar: Any, rng: random.Random) -> str | None:

        validator = ecma_validator()(case["schema"])
        compiled = self.compile(grammar, "bytes")
        canonical = [
            json.dumps(v, ensure_ascii=False, separators=(",", ":")).encode() for v in case["instances"]
        ]
        pool = canonical + self.generated(grammar, rng, 3)
        pool += mutations(rng.choice(pool) if pool else b"", rng, 6)
        accepted = []
        for k, data in enumerate(pool):
            got = self.byte_accepts(compiled, data)
            try:
                value = json.loads(data.decode("utf-8"), object_pairs_hook=no_duplicates)
                valid = validator.is_valid(value)
            except (UnicodeDecodeError, ValueError):
                value, valid = None, False
            except DuplicateKey:
                continue  # documented: additional members may repeat a key; validators see the last
            if not _finite(value):
                continue  # json.loads reads 1e400 as inf: jsonschema then sees 1e400 == 2e400
            if got and not valid:
                return f"matcher accepts {data!r}, which is not valid for the schema"
            if valid and not got and k < len(canonical) and policy_free(value):
                return f"matcher rejects {data!r}, which is valid (canonical, no objects)"
            if got:
                accepted.append(data.decode("utf-8"))
        return self._mask_check(case, grammar, accepted, rng)

    def _run_stress(self, case: dict[str, Any], rng: random.Random) -> str | None:
        """Robustness only (no reference at these sizes): build, compile, then decode generated
        strings the matcher accepts, checking masks along one of them."""
        front, source = case["front"], case["source"]
        if front == "regex":
            grammar = self.Grammar.from_regex(source)
        elif front == "schema":
            grammar = self.Grammar.from_json_schema(source, **case["options"])
        else:
            grammar = self.Grammar.from_ebnf(source, syntax=front)
        compiled = self.compile(grammar, "bytes")
        problem = self.random_walk(compiled, rng)
        if problem:
            return problem
        accepted = [
            d.decode("utf-8") for d in self.generated(grammar, rng, 2) if self.byte_accepts(compiled, d)
        ]
        return self._mask_check(case, grammar, accepted, rng)

    def random_walk(self, compiled: Any, rng: random.Random, steps: int = 64) -> str | None:
        """Decode random bytes the mask allows over the bytes-only vocabulary; at a few steps the mask
        must equal what accept_token accepts, and every allowed byte must be accepted."""
        m = self.GrammarMatcher(compiled)
        picks = set(rng.sample(range(steps), MASK_POSITIONS))
        taken = bytearray()
        for step in range(steps):
            bits = self.support.mask_bits(m, 257)
            if step in picks:
                try:
                    self.support.assert_bits_match_acceptance(m, bits, step)
                except AssertionError as exc:
                    return f"mask differs from accept_token after bytes {bytes(taken)!r}: {exc}"
            allowed = [int(t) for t in bits.nonzero()[0]]
            if not allowed:
                return None if m.is_terminated() else f"empty mask after bytes {bytes(taken)!r}"
            token = rng.choice(allowed)
            if not m.accept_token(token):
                return f"mask allows token {token} after bytes {bytes(taken)!r}; accept_token rejects it"
            if token == 256:
                return None
            taken.append(token)
        return None

    def _mask_check(
        self, case: dict[str, Any], grammar: Any, accepted: list[str], rng: random.Random
    ) -> str | None:
        tokenizer = case.get("tokenizer", "bytes")
        if tokenizer == "bytes" or not accepted:
            return None
        return self.check_mask_path(self.compile(grammar, tokenizer), rng.choice(accepted), rng)


def _probe(action: str) -> None:
    """Fail on purpose, one way per failure kind: the harness's own tests."""
    if action == "abort":
        os.abort()
    if action == "segfault":
        import ctypes

        ctypes.string_at(0)
    if action == "allocate":
        limit_mb = int(os.environ.get("AGENT_INFER_FUZZ_MEMORY_MB", "0"))
        bytearray(((limit_mb + 512) << 20) if limit_mb else 1 << 46)
    if action == "raise":
        raise KeyError("probe")
    if action == "sleep":
        time.sleep(3600)


class _Slow(Exception):
    """A step ran past its documented time limit without raising GrammarLimitError."""


def verdict(checker: _Checker, case: dict[str, Any]) -> dict[str, Any]:
    """Run one case and classify the outcome (never raises)."""
    start = time.monotonic()
    try:
        problem = checker.run(case)
        result = {"status": "wrong", "detail": problem} if problem else {"status": "ok"}
    except checker.errors.AgentInferError as exc:
        result = {"status": "typed", "detail": f"{type(exc).__name__}: {exc}"[:500]}
    except _Slow as exc:
        result = {"status": "slow", "detail": str(exc)}
    except MemoryError:
        result = {
            "status": "blowup",
            "detail": "MemoryError (address-space limit)\n" + traceback.format_exc(),
        }
    except Exception as exc:
        # The exception first: a RecursionError's traceback is thousands of identical frames.
        head = f"{type(exc).__name__}: {str(exc)[:300]}"
        result = {"status": "untyped", "detail": f"{head}\n{traceback.format_exc()[-2500:]}"}
    result["seconds"] = round(time.monotonic() - start, 3)
    return result


def serve() -> None:
    """Answer one JSON line per request on the original stdout; everything printed goes to stderr."""
    import faulthandler
    import resource

    faulthandler.enable()
    from agent_infer.native import load_native

    load_native()  # first, so AGENT_INFER_NATIVE_LIBRARY (a sanitized build) is the one every import gets
    limit_mb = int(os.environ.get("AGENT_INFER_FUZZ_MEMORY_MB", "0"))
    if limit_mb > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit_mb << 20, limit_mb << 20))
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    checker = _Checker()
    for line in sys.stdin:
        request = json.loads(line)
        if request.get("op") == "warm":
            checker.warm(request["tokenizers"])
            channel.write(json.dumps({"status": "ok"}) + "\n")
        else:
            channel.write(json.dumps(verdict(checker, request["case"])) + "\n")


def main(argv: list[str]) -> None:
    if argv == ["--serve"]:
        serve()
        return
    for path in argv:
        with open(path, encoding="utf-8") as f:
            case = json.load(f)
        print(json.dumps(verdict(_Checker(), case.get("case", case)), indent=1))


def _finite(value: Any) -> bool:
    """Whether no number in ``value`` overflowed to an infinite float when parsed."""
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    return True


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(sys.argv[1:])
