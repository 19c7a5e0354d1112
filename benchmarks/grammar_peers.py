"""Engine adapters for ``bench_grammar.py``: agent-infer, XGrammar, llguidance and outlines-core.

Every engine is wrapped behind the same small interface so the harness times exactly the same
operations for all of them:

* :meth:`Engine.compile` turns a JSON Schema into a fresh :class:`Matcher` (no cross-schema reuse);
* :meth:`Matcher.fill` writes one row of an int32 ``[batch, ceil(vocab/32)]`` bitmask
  (bit ``j`` of word ``w`` = token ``32*w + j``);
* :meth:`Matcher.accept` advances by one token and returns ``False`` (never raises) on rejection;
* :meth:`Matcher.can_terminate` says whether the input so far is a complete document;
* :meth:`Matcher.reset` returns to the start state.

Engine-side tokenizer tables are built once per worker process in ``Engine.__init__`` and are not
part of any timing. Each adapter states its whitespace and cache policy in ``Engine.settings``.
Imports of the engines happen inside the adapters so a worker only loads the engine it runs.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer as the workers see it: a ``tokenizer.json`` plus the EOS id and mask width."""

    name: str
    tokenizer_json: str
    eos_id: int
    vocab_size: int
    eos_token: str

    @property
    def mask_words(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab_size + 31) // 32


class CompileError(Exception):
    """The engine refused the schema (unsupported/invalid schema, grammar limit, ...)."""

    def __init__(self, category: str, message: str) -> None:
        super().__init__(message)
        self.category = category


class MatcherError(Exception):
    """The engine entered an error state while matching (reported by llguidance as a state)."""


class Matcher(ABC):
    """One grammar matcher; see the module docstring for the contract."""

    @abstractmethod
    def fill(self, bitmask: Any, index: int = 0) -> None:
        """Write the next-token mask into row ``index`` of the engine's native bitmask."""

    @abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by ``token``; ``False`` if the engine rejects it."""

    @abstractmethod
    def can_terminate(self) -> bool:
        """True if the tokens accepted so far form a complete document."""

    @abstractmethod
    def reset(self) -> None:
        """Back to the start state."""

    @abstractmethod
    def fresh(self) -> Matcher:
        """A new matcher at the start state over the same compiled grammar (no recompilation)."""


class Engine(ABC):
    """One engine bound to one tokenizer."""

    name: ClassVar[str]
    has_batch: ClassVar[bool] = True  # False: batch_fill raises NotImplementedError
    settings: dict[str, str]

    def __init__(self, spec: TokenizerSpec, options: dict[str, Any] | None = None) -> None:
        self.spec = spec
        self.options = dict(options or {})
        self.settings = {}

    def before_schema(self) -> None:
        """Untimed per-schema setup (e.g. dropping cross-schema caches for a cold compile)."""
        return

    @abstractmethod
    def compile(self, schema: Any) -> Matcher:
        """Compile ``schema`` from scratch and return a matcher at the start state."""

    def allocate(self, batch: int) -> tuple[Any, np.ndarray]:
        """A bitmask in the engine's native type, plus a numpy view of the same memory."""
        arr = np.zeros((batch, self.spec.mask_words), dtype=np.int32)
        return arr, arr

    def batch_fill(self, matchers: list[Matcher], bitmask: Any, num_threads: int) -> None:
        """Fill rows ``0..len(matchers)`` in one call using the engine's own thread pool."""
        raise NotImplementedError(f"{self.name} has no batch mask fill")

    def restart(self, matchers: list[Matcher], schemas: list[Any]) -> list[Matcher]:
        """Fresh start-state matchers for ``schemas`` with the same cache state the originals had."""
        return [m.fresh() for m in matchers]

    dist: ClassVar[str] = ""

    def version(self) -> str:
        """Installed distribution version, for the results header."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(self.dist)
        except (PackageNotFoundError, ValueError):
            return "?"


def _hf_tokenizer(spec: TokenizerSpec) -> Any:
    """A fast Hugging Face tokenizer over the cached ``tokenizer.json`` (what XGrammar wants)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=spec.tokenizer_json, eos_token=spec.eos_token)


# --- agent-infer ------------------------------------------------------------------------------------


class _OursMatcher(Matcher):
    def __init__(self, matcher: Any, compiled: Any, cls: Any) -> None:
        self.m = matcher
        self._compiled = compiled
        self._cls = cls

    def fill(self, bitmask: Any, index: int = 0) -> None:
        self.m.fill_next_token_bitmask(bitmask, index)

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    def can_terminate(self) -> bool:
        return bool(self.m.can_terminate())

    def reset(self) -> None:
        self.m.reset()

    def fresh(self) -> Matcher:
        return _OursMatcher(self._cls(self._compiled), self._compiled, self._cls)


def _kwargs_supported(fn: Any, wanted: dict[str, Any]) -> dict[str, Any]:
    """The subset of ``wanted`` that ``fn`` accepts by name (the API is still settling)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(wanted)
    return {k: v for k, v in wanted.items() if k in params}


class OursEngine(Engine):
    """agent-infer's native matcher (``agent_infer.grammar``), compact whitespace when offered."""

    name = "ours"
    dist = "agent-infer"
    cache_mode: ClassVar[str] = "cold"

    def __init__(self, spec: TokenizerSpec, options: dict[str, Any] | None = None) -> None:
        super().__init__(spec, options)
        import tokenizers

        from agent_infer import grammar as g

        self.g = g
        tok = tokenizers.Tokenizer.from_file(spec.tokenizer_json)
        info_kwargs = _kwargs_supported(
            g.TokenizerInfo.from_tokenizer,
            {"eos_token_ids": [spec.eos_id], "stop_token_ids": [spec.eos_id], "vocab_size": spec.vocab_size},
        )
        self.info = g.TokenizerInfo.from_tokenizer(tok, **info_kwargs)
        ckw = _kwargs_supported(g.GrammarCompiler, {"max_threads": 1, "cache_enabled": False})
        self._compiler_kwargs = ckw
        self.compiler = g.GrammarCompiler(self.info, **ckw)
        # TokenizerInfo keeps a token-mask cache shared by every grammar compiled for it. "cold"
        # (default) rebuilds it from the decoded vocabulary before each schema (untimed, ~0.1 s) so
        # no schema profits from an earlier one, like XGrammar with cache_enabled=False; "warm"
        # keeps it across schemas, as a long-running server would.
        self.cold = self.cache_mode == "cold"
        # A tuple, which TokenizerInfo keeps as is: each rebuild then creates no new 129k-item
        # container for the cyclic GC to traverse inside the next timed compile.
        self._vocab = tuple(self.info.decoded_vocab) if self.cold else ()
        self._schema_kwargs = _kwargs_supported(self.compiler.compile_json_schema, {"whitespace": "compact"})
        # If the compiler's JSON entry point has no whitespace switch, go through the front end
        # (Grammar.from_json_schema(whitespace="compact")) and compile the IR: both are timed.
        self._compile_ir: Any = getattr(g.GrammarCompiler, "compile_grammar", None) or getattr(
            g.GrammarCompiler, "compile", None
        )
        self._via_grammar = "whitespace" not in self._schema_kwargs and self._compile_ir is not None
        whitespace = (
            "compact" if self._via_grammar else self._schema_kwargs.get("whitespace", "engine default")
        )
        self.settings = {
            "whitespace": f"whitespace={whitespace!r}",
            "schema": "strict (front-end default: unenforceable keyword = compile error)",
            "cache": ("cache_enabled=False" if "cache_enabled" in ckw else "no cache switch")
            + (
                "; TokenizerInfo mask cache rebuilt and front-end memos cleared per schema (cold; the"
                " first GrammarCompiler for a TokenizerInfo precomputes the common JSON string-content"
                " classes, as llguidance's slices)"
                if self.cold
                else "; TokenizerInfo mask cache kept (warm)"
            ),
            "threads": "max_threads=1" if "max_threads" in ckw else "default",
        }

    def before_schema(self) -> None:
        if self.cold:
            # The front ends' process-wide memos (key tries, pattern and format automata, shared
            # rule programs) would carry work from earlier schemas too.
            clear = getattr(self.g, "clear_grammar_caches", None)
            if clear is not None:
                clear()
            self.info = self.g.TokenizerInfo(
                self._vocab, vocab_size=self.info.vocab_size, eos_token_ids=self.info.eos_token_ids
            )
            self.compiler = self.g.GrammarCompiler(self.info, **self._compiler_kwargs)

    def compile(self, schema: Any) -> Matcher:
        from agent_infer.errors import AgentInferError

        try:
            if self._via_grammar:
                grammar = self.g.Grammar.from_json_schema(schema, whitespace="compact")
                compiled = self._compile_ir(self.compiler, grammar)
            else:
                compiled = self.compiler.compile_json_schema(schema, **self._schema_kwargs)
        except AgentInferError as e:
            raise CompileError(type(e).__name__, str(e)) from e
        return _OursMatcher(self.g.GrammarMatcher(compiled), compiled, self.g.GrammarMatcher)

    def restart(self, matchers: list[Matcher], schemas: list[Any]) -> list[Matcher]:
        if not self.cold:
            return super().restart(matchers, schemas)
        # The mask cache lives in TokenizerInfo, shared by every compiled grammar: a cold restart
        # means a new TokenizerInfo and recompiling the batch against it.
        self.before_schema()
        return [self.compile(s) for s in schemas]

    def allocate(self, batch: int) -> tuple[Any, np.ndarray]:
        bm = self.g.allocate_token_bitmask(batch, self.spec.vocab_size)
        view = bm.numpy() if hasattr(bm, "numpy") else np.asarray(bm)
        return bm, view

    def batch_fill(self, matchers: list[Matcher], bitmask: Any, num_threads: int) -> None:
        native = [m.m for m in matchers]  # type: ignore[attr-defined]
        self.g.fill_next_token_bitmask_batch(native, bitmask, num_threads=num_threads)

    def version(self) -> str:
        import subprocess

        # The engine is built from this checkout: the commit (and a dirty flag) is the version.
        try:
            rev = subprocess.run(
                ["git", "describe", "--always", "--dirty"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).resolve().parent,
                timeout=10,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            rev = ""
        # A dirty tree is not reproducible from the commit: add a digest of the code that ran.
        digest = hashlib.sha1()
        from agent_infer.native import load_native

        native = getattr(load_native(), "__file__", None)
        files = sorted(Path(self.g.__file__).parent.glob("*.py")) + ([Path(native)] if native else [])
        for f in files:
            digest.update(f.read_bytes())
        return f"agent-infer {rev or '?'} (grammar+native sha1 {digest.hexdigest()[:10]})"


class OursWarmEngine(OursEngine):
    """agent-infer with its tokenizer-level mask cache kept across schemas (a long-running server)."""

    name = "ours-warm"
    cache_mode = "warm"


class OursBaselineEngine(OursEngine):
    """agent-infer from another build (``--baseline DIR``: a folder holding an installed
    ``agent_infer`` package with its native extension, e.g. an unpacked wheel of an earlier commit),
    run beside this checkout's "ours" so that a change is timed against its baseline on the same
    machine, schema by schema."""

    name = "ours-base"

    def __init__(self, spec: TokenizerSpec, options: dict[str, Any] | None = None) -> None:
        folder = (options or {}).get("baseline")
        if not folder or not (Path(folder) / "agent_infer" / "__init__.py").is_file():
            raise RuntimeError("ours-base needs --baseline DIR with an agent_infer package in it")
        if "agent_infer" in sys.modules:
            raise RuntimeError("ours-base must run in a worker that has not imported agent_infer")
        # An editable install redirects imports of agent_infer to this checkout ahead of sys.path.
        sys.meta_path[:] = [f for f in sys.meta_path if "Redirecting" not in type(f).__name__]
        sys.path.insert(0, str(folder))
        super().__init__(spec, options)
        if not str(Path(self.g.__file__).resolve()).startswith(str(Path(folder).resolve())):
            raise RuntimeError(f"ours-base imported agent_infer from {self.g.__file__}, not {folder}")

    def version(self) -> str:
        return f"agent-infer baseline at {self.options.get('baseline')}"


# --- XGrammar -------------------------------------------------------------------------------------


class _XgrMatcher(Matcher):
    def __init__(self, matcher: Any, compiled: Any, cls: Any) -> None:
        self.m = matcher
        self._compiled = compiled
        self._cls = cls

    def fill(self, bitmask: Any, index: int = 0) -> None:
        self.m.fill_next_token_bitmask(bitmask, index)

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    def can_terminate(self) -> bool:
        return bool(self.m.is_completed())

    def reset(self) -> None:
        self.m.reset()

    def fresh(self) -> Matcher:
        return _XgrMatcher(self._cls(self._compiled), self._compiled, self._cls)


class XGrammarEngine(Engine):
    """XGrammar: compact separators, no flexible whitespace, non-strict (JSON Schema semantics)."""

    name = "xgrammar"
    dist = "xgrammar"

    def __init__(self, spec: TokenizerSpec, options: dict[str, Any] | None = None) -> None:
        super().__init__(spec, options)
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(
            _hf_tokenizer(spec), vocab_size=spec.vocab_size, stop_token_ids=[spec.eos_id]
        )
        # cache_enabled=False: XGrammar's caches would otherwise carry work across schemas.
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.settings = {
            "whitespace": "any_whitespace=False, separators=(',', ':')",
            "cache": "cache_enabled=False",
            "threads": "max_threads=1",
            # strict_mode=True would forbid additional properties/items the schema allows.
            "schema": "strict_mode=False",
        }
        self._batch: Any = None
        self._batch_threads = 0

    def compile(self, schema: Any) -> Matcher:
        try:
            compiled = self.compiler.compile_json_schema(
                json.dumps(schema),
                any_whitespace=False,
                separators=(",", ":"),
                strict_mode=False,
            )
        except Exception as e:  # XGrammar reports schema problems as RuntimeError/ValueError
            raise CompileError(type(e).__name__, str(e)) from e
        return _XgrMatcher(self.xgr.GrammarMatcher(compiled), compiled, self.xgr.GrammarMatcher)

    def batch_fill(self, matchers: list[Matcher], bitmask: Any, num_threads: int) -> None:
        if self._batch is None or self._batch_threads != num_threads:
            self._batch = self.xgr.BatchGrammarMatcher(max_threads=num_threads)
            self._batch_threads = num_threads
        self._batch.batch_fill_next_token_bitmask([m.m for m in matchers], bitmask)  # type: ignore[attr-defined]


# --- llguidance -----------------------------------------------------------------------------------


class _LlgMatcher(Matcher):
    def __init__(self, matcher: Any, rebuild: Any) -> None:
        self.m = matcher
        self._rebuild = rebuild

    def fill(self, bitmask: Any, index: int = 0) -> None:
        row = bitmask[index]
        self.m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        # llguidance reports grammar errors and limits as a sticky state, not an exception.
        if self.m.is_error():
            raise MatcherError(self.m.get_error())

    def accept(self, token: int) -> bool:
        return bool(self.m.consume_token(token)) and not self.m.is_error()

    def can_terminate(self) -> bool:
        return bool(self.m.is_accepting())

    def reset(self) -> None:
        # A rejected token leaves an LLMatcher in a sticky error state that reset() keeps, so
        # build a new one then (reset is never timed).
        if self.m.is_error():
            self.m = self._rebuild()
        else:
            self.m.reset()

    def fresh(self) -> Matcher:
        return _LlgMatcher(self._rebuild(), self._rebuild)


class LLGuidanceEngine(Engine):
    """llguidance: ``whitespace_flexible=False`` (compact), default slices and parser limits."""

    name = "llguidance"
    dist = "llguidance"

    def __init__(self, spec: TokenizerSpec, options: dict[str, Any] | None = None) -> None:
        super().__init__(spec, options)
        import llguidance

        self.llg = llguidance
        text = Path(spec.tokenizer_json).read_text(encoding="utf-8")
        self.tok = llguidance.LLTokenizer(text, n_vocab=spec.vocab_size, eos_token=spec.eos_id)
        self.settings = {
            "whitespace": "whitespace_flexible=False",
            "cache": "none (no cross-grammar cache)",
            "threads": "single matcher; LLExecutor(num_threads=N) in --batch",
        }
        self._executor: Any = None
        self._executor_threads = 0

    def compile(self, schema: Any) -> Matcher:
        try:
            grammar = self.llg.LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": False}
            )
            m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        except Exception as e:
            raise CompileError(type(e).__name__, str(e)) from e
        if m.is_error():
            raise CompileError("LLMatcherError", m.get_error())
        return _LlgMatcher(m, lambda: self.llg.LLMatcher(self.tok, grammar, log_level=0))

    def batch_fill(self, matchers: list[Matcher], bitmask: Any, num_threads: int) -> None:
        if self._executor is None or self._executor_threads != num_threads:
            self._executor = self.llg.LLExecutor(num_threads=num_threads)
            self._executor_threads = num_threads
        pairs = [(m.m, i) for i, m in enumerate(matchers)]  # type: ignore[attr-defined]
        self._executor.unsafe_compute_mask_ptr(
            pairs, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0]
        )


# --- outlines-core --------------------------------------------------------------------------------


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to 256+."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in table.values():
            table[chr(256 + extra)] = b
            extra += 1
    return table


def token_bytes_table(spec: TokenizerSpec) -> dict[int, bytes]:
    """Raw bytes of every non-special token of a byte-level BPE ``tokenizer.json``."""
    data = json.loads(Path(spec.tokenizer_json).read_text(encoding="utf-8"))
    if "ByteLevel" not in json.dumps(data.get("decoder") or {}):
        raise ValueError(f"{spec.name}: only byte-level BPE tokenizers are supported by this adapter")
    dec = _byte_level_decoder()
    out: dict[int, bytes] = {}
    for text, tid in data["model"]["vocab"].items():
        try:
            out[tid] = bytes(dec[c] for c in text)
        except KeyError:
            continue  # not byte-level text: cannot be produced by this tokenizer's decoder
    for added in data.get("added_tokens", []):
        out.pop(added["id"], None)  # special/added tokens never appear inside JSON text
    return out


class _OutlinesMatcher(Matcher):
    def __init__(self, guide: Any, words: int, index: Any) -> None:
        self.g = guide
        self.words = words
        self._index = index

    def fill(self, bitmask: Any, index: int = 0) -> None:
        row = bitmask[index]
        self.g.write_mask_into(row.ctypes.data, self.words, 4)

    def accept(self, token: int) -> bool:
        try:
            self.g.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def can_terminate(self) -> bool:
        return bool(self.g.is_finished())

    def reset(self) -> None:
        self.g.reset()

    def fresh(self) -> Matcher:
        return _OutlinesMatcher(type(self.g)(self._index), self.words, self._index)


class OutlinesEngine(Engine):
    """outlines-core: regex from the schema with ``whitespace_pattern=""`` (compact), then an Index."""

    name = "outlines"
    has_batch = False
    dist = "outlines_core"

    def __init__(self, spec: TokenizerSpec, options: dict[str, Any] | None = None) -> None:
        super().__init__(spec, options)
        import outlines_core

        self.oc = outlines_core
        groups: dict[bytes, list[int]] = {}
        for tid, b in token_bytes_table(spec).items():
            if tid != spec.eos_id and b:
                groups.setdefault(b, []).append(tid)
        self.vocab = outlines_core.Vocabulary(spec.eos_id, groups)
        self.settings = {
            "whitespace": 'whitespace_pattern="" (compact)',
            "cache": "none",
            "threads": "single (Index build)",
            "schema": "max_recursion_depth=3 (default)",
        }

    def compile(self, schema: Any) -> Matcher:
        from outlines_core.json_schema import build_regex_from_schema

        try:
            regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern="")
            index = self.oc.Index(regex, self.vocab)
        except Exception as e:  # outlines raises ValueError/TypeError for unsupported schemas
            raise CompileError(type(e).__name__, str(e)) from e
        return _OutlinesMatcher(self.oc.Guide(index), self.spec.mask_words, index)


ENGINES: dict[str, type[Engine]] = {
    e.name: e
    for e in (
        OursEngine,
        OursWarmEngine,
        OursBaselineEngine,
        XGrammarEngine,
        LLGuidanceEngine,
        OutlinesEngine,
    )
}
