"""GrammarCompiler: lowers IR grammars to native byte automata for one tokenizer, with an LRU cache."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from agent_infer.errors import GrammarDefinitionError, GrammarLimitError
from agent_infer.grammar.ir import Alt, CharClass, Empty, Expr, Grammar, Literal, Ref, Repeat, Seq
from agent_infer.grammar.tokenizer_info import TokenizerInfo
from agent_infer.native import load_native

# Opcodes shared with engine_native/src/grammar.h (enum Op).
_EMPTY, _LITERAL, _CLASS, _SEQ, _ALT, _REPEAT, _REF = range(7)
_INT32_MAX = 2**31 - 1

DEFAULT_MAX_STATES = 500_000
DEFAULT_MAX_COMPILE_SECONDS = 30.0
DEFAULT_MAX_ITEMS_PER_STEP = 200_000


def _serialize_expr(expr: Expr, index: dict[str, int], out: list[int]) -> None:
    """Append the prefix encoding of ``expr`` (see grammar.h) to ``out``."""
    stack: list[Expr] = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, Literal):
            try:
                data = node.text.encode("utf-8")
            except UnicodeEncodeError:
                raise GrammarDefinitionError(
                    f"literal {node.text!r} contains a lone surrogate, which has no UTF-8 encoding"
                ) from None
            out.append(_LITERAL)
            out.append(len(data))
            out.extend(data)
        elif isinstance(node, CharClass):
            ranges = node.normalized()
            out.append(_CLASS)
            out.append(len(ranges))
            for lo, hi in ranges:
                out.append(lo)
                out.append(hi)
        elif isinstance(node, Seq | Alt):
            out.append(_SEQ if isinstance(node, Seq) else _ALT)
            out.append(len(node.items))
            stack.extend(reversed(node.items))
        elif isinstance(node, Repeat):
            if node.min > _INT32_MAX or (node.max is not None and node.max > _INT32_MAX):
                raise GrammarLimitError(f"repeat bounds {{{node.min},{node.max}}} are too large")
            out.append(_REPEAT)
            out.append(node.min)
            out.append(-1 if node.max is None else node.max)
            stack.append(node.item)
        elif isinstance(node, Ref):
            out.append(_REF)
            out.append(index[node.name])
        elif isinstance(node, Empty):
            out.append(_EMPTY)
        else:
            raise GrammarDefinitionError(f"not an IR node: {node!r}")


def serialize_grammar(grammar: Grammar) -> tuple[list[list[int]], int]:
    """Flat per-rule integer programs and the root's rule index."""
    index = {name: i for i, (name, _) in enumerate(grammar.rules)}
    programs: list[list[int]] = []
    for _, expr in grammar.rules:
        code: list[int] = []
        _serialize_expr(expr, index, code)
        programs.append(code)
    return programs, index[grammar.root]


class CompiledGrammar:
    """A grammar lowered for one tokenizer. Immutable and safe to share between threads and matchers."""

    def __init__(self, grammar: Grammar, tokenizer_info: TokenizerInfo, native: Any) -> None:
        self._grammar = grammar
        self._tokenizer_info = tokenizer_info
        self._native = native

    @property
    def grammar(self) -> Grammar:
        """The IR grammar this was compiled from."""
        return self._grammar

    @property
    def tokenizer_info(self) -> TokenizerInfo:
        """The tokenizer the masks are computed for."""
        return self._tokenizer_info

    @property
    def warnings(self) -> tuple[str, ...]:
        """Constraints the front end could not enforce (``grammar.warnings``)."""
        return self._grammar.warnings

    @property
    def memory_size_bytes(self) -> int:
        """Approximate native memory held by the automata (shared token-mask caches excluded)."""
        return int(self._native.memory_bytes())

    @property
    def num_states(self) -> int:
        """Number of byte-automaton states after determinization and trimming."""
        return int(self._native.num_states)

    def __repr__(self) -> str:
        return f"CompiledGrammar(states={self.num_states}, bytes={self.memory_size_bytes})"


class GrammarCompiler:
    """Compiles grammars for one tokenizer; results are cached by grammar fingerprint (LRU, byte budget)."""

    def __init__(
        self,
        tokenizer_info: TokenizerInfo,
        *,
        max_threads: int = 1,
        cache_enabled: bool = True,
        cache_limit_bytes: int = 256 * 1024 * 1024,
        max_states: int = DEFAULT_MAX_STATES,
        max_compile_seconds: float = DEFAULT_MAX_COMPILE_SECONDS,
        max_items_per_step: int = DEFAULT_MAX_ITEMS_PER_STEP,
    ) -> None:
        """``max_states``/``max_compile_seconds``/``max_items_per_step`` raise GrammarLimitError when exceeded.

        ``max_threads`` is accepted for XGrammar compatibility; compilation runs on the calling thread
        with the GIL released, so callers may compile from several threads at once.
        """
        self.tokenizer_info = tokenizer_info
        self.max_threads = max_threads
        self._cache_enabled = cache_enabled
        self._cache_limit = cache_limit_bytes
        self._max_states = max_states
        self._max_seconds = max_compile_seconds
        self._max_items = max_items_per_step
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()

    def compile(self, grammar: Grammar) -> CompiledGrammar:
        """Compile an IR grammar (cached). Raises GrammarDefinitionError for an empty language."""
        try:
            key = grammar.fingerprint() if self._cache_enabled else ""
        except RecursionError:
            raise GrammarLimitError(
                "grammar expressions are nested too deeply to print/fingerprint"
            ) from None
        if self._cache_enabled:
            with self._lock:
                hit = self._cache.get(key)
                if hit is not None:
                    self._cache.move_to_end(key)
                    return hit
        programs, root = serialize_grammar(grammar)
        native = load_native().CompiledGrammar(
            self.tokenizer_info._native, programs, root, self._max_states, self._max_seconds, self._max_items
        )
        compiled = CompiledGrammar(grammar, self.tokenizer_info, native)
        if self._cache_enabled:
            size = compiled.memory_size_bytes
            with self._lock:
                if key not in self._cache:
                    self._cache[key] = compiled
                    self._cache_bytes += size
                while self._cache_bytes > self._cache_limit and len(self._cache) > 1:
                    _, old = self._cache.popitem(last=False)
                    self._cache_bytes -= old.memory_size_bytes
        return compiled

    def compile_json_schema(self, schema: Any, **kwargs: Any) -> CompiledGrammar:
        """JSON Schema (dict, JSON text, Pydantic model) -> compiled grammar; kwargs go to Grammar.from_json_schema."""
        return self.compile(Grammar.from_json_schema(schema, **kwargs))

    def compile_regex(self, pattern: str) -> CompiledGrammar:
        """A Python-syntax regex, matched in full."""
        return self.compile(Grammar.from_regex(pattern))

    def compile_ebnf(self, text: str, *, syntax: str = "gbnf", start: str | None = None) -> CompiledGrammar:
        """GBNF (default) or Lark grammar text."""
        return self.compile(Grammar.from_ebnf(text, syntax=syntax, start=start))

    def compile_builtin(self, name: str) -> CompiledGrammar:
        """One of the grammars shipped in ``grammars/`` (e.g. ``json``)."""
        return self.compile(Grammar.builtin(name))

    def clear_cache(self) -> None:
        """Drop every cached compiled grammar."""
        with self._lock:
            self._cache.clear()
            self._cache_bytes = 0

    @property
    def cache_size_bytes(self) -> int:
        """Bytes held by cached compiled grammars."""
        return self._cache_bytes
