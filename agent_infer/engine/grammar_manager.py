"""Grammar constraints inside the engine: lower per request, compile in a pool, mask logits.

The two-level interface between engine and grammar (vLLM v1 style): the engine lowers a
constrained request's constraint when it arrives (cheap; a bad constraint fails that request at
once), submits the token-level compile to a worker pool, and hands each step's sampling rows to
be masked. Everything grammar-specific (tokenizer vocabulary bytes, compile cache) lives here.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from agent_infer import envs
from agent_infer.engine.grammar_worker import GrammarWorkerPool
from agent_infer.engine.mask_filler import MaskFiller, PendingMasks
from agent_infer.errors import GrammarError, InvalidRequestError
from agent_infer.structured import StructuredOutput

if TYPE_CHECKING:
    from agent_infer.engine.sequence import Sequence
    from agent_infer.grammar.compile.compiler import CompiledGrammar, GrammarCompiler
    from agent_infer.grammar.ir import Grammar
    from agent_infer.grammar.runtime.matcher import GrammarMatcher
    from agent_infer.model.tokenizer import Tokenizer


_LOWERED_CACHE_SIZE = 256


def _lowering_key(structured: StructuredOutput) -> Hashable | None:
    """What determines a constraint's IR, or None when it is cheap or already IR (not cached).

    Schema dicts are keyed by their JSON text in declared order (property order is part of the
    grammar); Pydantic models by the class object itself.
    """
    if structured.kind == "grammar":
        return None
    try:
        value: Hashable = structured.value
        if structured.kind == "json_schema":
            value = structured.model if structured.model is not None else json.dumps(structured.value)
        key = (structured.kind, value, structured.options)
        hash(key)
    except (TypeError, ValueError):  # not JSON-serializable or not hashable: lower every time
        return None
    return key


@dataclass
class GrammarTimings:
    """Cumulative grammar work since the engine started, read by metrics (e.g. the server's /metrics)."""

    compiles: int = 0
    compile_seconds: float = 0.0
    mask_fills: int = 0
    mask_seconds: float = 0.0


class GrammarManager:
    """Compiles request constraints for one model's tokenizer and applies their token masks.

    ``num_workers`` threads compile grammars; ``overlap`` fills bitmasks on a background thread
    during the forward pass (see :mod:`agent_infer.engine.mask_filler`).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        *,
        num_workers: int = 2,
        overlap: bool = False,
        text_special_tokens: Seq[str] = (),
    ) -> None:
        """``text_special_tokens``: added tokens that stand for their own text in masks (the model's
        tool-call delimiters), so a grammar literal spelling one allows the single token the model
        was trained to write; those missing from the vocabulary are left out."""
        self._tokenizer = tokenizer
        self._text_special = tuple(
            t for t in text_special_tokens if tokenizer.hf_tokenizer.token_to_id(t) is not None
        )
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._pool = GrammarWorkerPool(self.compile, num_workers)
        self.filler = MaskFiller(vocab_size, overlap=overlap)
        self._timings = GrammarTimings()
        self._lowered: OrderedDict[Hashable, Grammar] = OrderedDict()
        self._lowered_lock = threading.Lock()
        self._timings_lock = threading.Lock()
        # Read once: the environment lookup costs more than masking a few cached rows.
        self._mask_backend = envs.mask_backend()
        self._native_cpu_apply = self._mask_backend in ("auto", "cpu")

    @property
    def compiler(self) -> GrammarCompiler:
        """The compiler, built on first use (reading the vocabulary's bytes takes ~0.5 s)."""
        with self._lock:
            if self._compiler is None:
                from agent_infer.grammar.compile.compiler import GrammarCompiler
                from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo

                info = TokenizerInfo.from_tokenizer(
                    self._tokenizer.hf_tokenizer,
                    vocab_size=self._vocab_size,
                    eos_token_ids=self._eos,
                    text_special_tokens=self._text_special,
                )
                self._compiler = GrammarCompiler(info)
            return self._compiler

    # --- compile -----------------------------------------------------------------------------------

    def lower(self, structured: StructuredOutput) -> Grammar:
        """Constraint -> IR; a front-end error becomes InvalidRequestError(field="structured").

        Lowered grammars are kept in a small LRU: agents send the same schema request after
        request, and lowering a schema with patterns or formats can take tens of milliseconds
        on the engine thread.
        """
        key = _lowering_key(structured)
        if key is not None:
            with self._lowered_lock:
                hit = self._lowered.get(key)
                if hit is not None:
                    self._lowered.move_to_end(key)
                    return hit
        try:
            grammar = structured.to_grammar()
        except GrammarError as exc:
            raise InvalidRequestError(f"invalid constraint: {exc}", field="structured") from exc
        if key is not None:
            with self._lowered_lock:
                self._lowered[key] = grammar
                while len(self._lowered) > _LOWERED_CACHE_SIZE:
                    self._lowered.popitem(last=False)
        return grammar

    def compile(self, grammar: Grammar) -> CompiledGrammar:
        """Token-level compile of a lowered grammar (cached across requests by the compiler)."""
        start = time.perf_counter()
        try:
            return self.compiler.compile(grammar)
        finally:
            elapsed = time.perf_counter() - start
            with self._timings_lock:
                self._timings.compiles += 1
                self._timings.compile_seconds += elapsed

    def timings(self) -> GrammarTimings:
        """A copy of the cumulative compile and mask-fill counters."""
        with self._timings_lock:
            return dataclasses.replace(self._timings)

    def submit(self, grammar: Grammar) -> Future[GrammarMatcher]:
        """Compile ``grammar`` in the worker pool; the future yields a fresh matcher."""
        return self._pool.submit(grammar)

    def new_matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        """Lower and compile synchronously: a fresh matcher for one request."""
        from agent_infer.grammar.runtime.matcher import GrammarMatcher

        grammar = self.lower(structured)
        try:
            return GrammarMatcher(self.compile(grammar))
        except GrammarError as exc:
            raise InvalidRequestError(f"invalid constraint: {exc}", field="structured") from exc

    # --- masks -------------------------------------------------------------------------------------

    def start_masks(
        self, seqs: list[Sequence], drafts: list[tuple[int, ...]] | None = None
    ) -> PendingMasks | None:
        """Begin filling the bitmask for sampling sequences ``seqs`` (in order; ``drafts[i]`` adds a
        row per draft token of ``seqs[i]``); None if none is constrained."""
        return self.filler.start([seq.matcher for seq in seqs], drafts)

    def apply_masks(self, logits: torch.Tensor, pending: PendingMasks | None) -> None:
        """Join the fill started by :meth:`start_masks` and ``-inf`` the disallowed logits.

        Rows whose mask allows every token are skipped. Float32 CPU logits are masked by the fill
        itself in one native call (unless ``AGENT_INFER_MASK_BACKEND`` names a backend other than
        ``cpu``); others through :func:`apply_token_bitmask_rows`.
        """
        if pending is None:
            return
        if (
            self._native_cpu_apply
            and logits.is_cpu
            and logits.dtype is torch.float32
            and logits.dim() == 2
            and logits.is_contiguous()
        ):
            pending.apply_cpu(logits)
        else:
            from agent_infer.grammar.runtime.bitmask import apply_token_bitmask_rows

            bitmask = pending.result()
            if pending.restricting:
                apply_token_bitmask_rows(logits, bitmask, pending.restricting, backend=self._mask_backend)
        with self._timings_lock:
            self._timings.mask_fills += 1
            self._timings.mask_seconds += pending.fill_seconds

    def shutdown(self) -> None:
        """Stop the compile pool and the fill thread."""
        self._pool.shutdown()
        self.filler.shutdown()
