"""Grammar constraints inside the engine: compile per request, mask logits, advance matchers.

The two-level interface between engine and grammar (vLLM v1 style): the engine asks this manager
for a matcher when a constrained request arrives, and hands it each step's logits rows to mask.
Everything grammar-specific (tokenizer vocabulary bytes, compile cache) lives behind it.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from agent_infer.errors import GrammarError, InvalidRequestError
from agent_infer.structured import StructuredOutput

if TYPE_CHECKING:
    from agent_infer.engine.sequence import Sequence
    from agent_infer.grammar.compiler import CompiledGrammar, GrammarCompiler
    from agent_infer.grammar.matcher import GrammarMatcher
    from agent_infer.model.tokenizer import Tokenizer


class GrammarManager:
    """Compiles request constraints for one model's tokenizer and applies their token masks."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = sorted(eos_token_ids)
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    @property
    def compiler(self) -> GrammarCompiler:
        """The compiler, built on first use (reading the vocabulary's bytes takes ~0.5 s)."""
        with self._lock:
            if self._compiler is None:
                from agent_infer.grammar.compiler import GrammarCompiler
                from agent_infer.grammar.tokenizer_info import TokenizerInfo

                info = TokenizerInfo.from_tokenizer(
                    self._tokenizer.hf_tokenizer, vocab_size=self._vocab_size, eos_token_ids=self._eos
                )
                self._compiler = GrammarCompiler(info)
            return self._compiler

    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        """Lower and compile one constraint; front-end errors surface as InvalidRequestError."""
        try:
            return self.compiler.compile(structured.to_grammar())
        except GrammarError as exc:
            raise InvalidRequestError(f"invalid constraint: {exc}", field="structured") from exc

    def new_matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for one request."""
        from agent_infer.grammar.matcher import GrammarMatcher

        return GrammarMatcher(self.compile(structured))

    def apply_masks(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Mask rows of ``logits`` (one per sequence, in order) whose sequence has a matcher."""
        rows = [i for i, seq in enumerate(seqs) if seq.matcher is not None]
        matchers = [m for m in (seq.matcher for seq in seqs) if m is not None]
        if not rows:
            return
        from agent_infer.grammar.bitmask import allocate_token_bitmask, apply_token_bitmask_inplace
        from agent_infer.grammar.matcher import fill_next_token_bitmask_batch

        bitmask = allocate_token_bitmask(len(seqs), logits.shape[-1])
        fill_next_token_bitmask_batch(matchers, bitmask, rows)
        index = torch.tensor(rows, dtype=torch.int64)
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
            apply_token_bitmask_inplace(logits, bitmask, index)
        else:
            apply_token_bitmask_inplace(logits, bitmask.to(logits.device), index.to(logits.device))
