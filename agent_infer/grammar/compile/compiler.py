"""GrammarCompiler: lowers IR grammars to native byte automata for one tokenizer, with an LRU cache."""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from agent_infer.errors import ConfigError, GrammarLimitError
from agent_infer.grammar.common.gc_pause import pauses_gc
from agent_infer.grammar.compile.serialize import program_key, serialize_for_compile
from agent_infer.grammar.compile.warmup import warm_string_contents
from agent_infer.grammar.ir import Grammar
from agent_infer.native import load_native

if TYPE_CHECKING:
    from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo

_INT32_MAX = 2**31 - 1

DEFAULT_MAX_STATES = 500_000
DEFAULT_MAX_COMPILE_SECONDS = 30.0
DEFAULT_MAX_ITEMS_PER_STEP = 200_000
# Grammar.from_json_schema's keyword options (compile_json_schema passes them on).
_JSON_SCHEMA_OPTIONS = frozenset(
    (
        "strict",
        "whitespace",
        "max_whitespace",
        "indent",
        "remotes",
        "unknown_formats",
        "unknown_keywords",
        "numbers",
    )
)
# Matching work (Earley items added plus origin-set items scanned by completions) for one
# accepted byte, and for all the Earley steps of one mask fill (or one shortest completion).
DEFAULT_MAX_WORK_PER_BYTE = 1_000_000
DEFAULT_MAX_WORK_PER_MASK = 16_000_000


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


def _check_count(name: str, value: Any, lo: int, hi: int | None) -> None:
    """ConfigError unless ``value`` is an integer in [lo, hi] (no upper end when ``hi`` is None)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        allowed = f"from {lo} to {hi}" if hi is not None else f"of at least {lo}"
        raise ConfigError(f"{name} must be an integer {allowed}, got {value!r}")


class GrammarCompiler:
    """Compiles grammars for one tokenizer; results are cached by rule programs (LRU, byte budget)."""

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
        max_work_per_byte: int = DEFAULT_MAX_WORK_PER_BYTE,
        max_work_per_mask: int = DEFAULT_MAX_WORK_PER_MASK,
    ) -> None:
        """``max_states``/``max_compile_seconds``/``max_items_per_step`` raise GrammarLimitError when exceeded.

        ``max_work_per_byte``/``max_work_per_mask`` bound a matcher's parsing work (Earley items
        added plus items of earlier sets scanned by completions) for one accepted byte and for one
        mask fill or shortest completion: highly ambiguous grammars (``root ::= root root | "a"``)
        cost more per byte the longer the input, and raise GrammarLimitError (the matcher left as
        before the call) instead of stalling.

        ``max_threads`` is accepted for XGrammar compatibility; compilation runs on the calling thread
        with the GIL released, so callers may compile from several threads at once.
        Options out of range raise ConfigError naming them: ``max_states`` and
        ``max_items_per_step`` are integers in [1, 2**31 - 1], ``max_compile_seconds`` a number
        above 0 (``inf``: no budget), ``max_threads`` an integer of at least 1,
        ``cache_limit_bytes`` one of at least 0, ``cache_enabled`` a bool, ``max_work_per_byte`` and
        ``max_work_per_mask`` integers in [1, 2**62 - 1].
        """
        _check_count("max_states", max_states, 1, _INT32_MAX)
        _check_count("max_items_per_step", max_items_per_step, 1, _INT32_MAX)
        _check_count("max_threads", max_threads, 1, None)
        _check_count("cache_limit_bytes", cache_limit_bytes, 0, None)
        if (
            not isinstance(max_compile_seconds, int | float)
            or isinstance(max_compile_seconds, bool)
            or not max_compile_seconds > 0  # NaN too
        ):
            raise ConfigError(
                f"max_compile_seconds must be a number above 0 (inf for no budget), got {max_compile_seconds!r}"
            )
        if not isinstance(cache_enabled, bool):
            raise ConfigError(f"cache_enabled must be True or False, got {cache_enabled!r}")
        self.tokenizer_info = tokenizer_info
        self.max_threads = max_threads
        self._cache_enabled = cache_enabled
        self._cache_limit = cache_limit_bytes
        self._max_states = max_states
        self._max_seconds = max_compile_seconds
        self._max_items = max_items_per_step
        _check_count("max_work_per_byte", max_work_per_byte, 1, 2**62 - 1)
        _check_count("max_work_per_mask", max_work_per_mask, 1, 2**62 - 1)
        self._max_work = (max_work_per_byte, max_work_per_mask)
        self._cache: OrderedDict[str, CompiledGrammar] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()
        warm_string_contents(tokenizer_info, _default_lowering(tokenizer_info))

    def _lower(self, programs: Any, root: int) -> Any:
        """The native compiled grammar of serialized ``programs`` under this compiler's limits."""
        return load_native().compile_serialized(
            self.tokenizer_info._native,
            programs,
            root,
            self._max_states,
            self._max_seconds,
            self._max_items,
            *self._max_work,
        )

    @pauses_gc
    def compile(self, grammar: Grammar) -> CompiledGrammar:
        """Compile an IR grammar (cached). Raises GrammarDefinitionError for an empty language."""
        programs: Any = None
        key = ""
        if self._cache_enabled:
            key = getattr(grammar, "_compile_key", "")
            if not key:
                programs, root = serialize_for_compile(grammar)
                key = program_key(grammar, programs, root)
                # Grammars are immutable: the key is kept on the instance, so a grammar compiled
                # again (the engine reuses lowered grammars across requests) costs a dict lookup.
                object.__setattr__(grammar, "_compile_key", key)
            with self._lock:
                hit = self._cache.get(key)
                if hit is not None:
                    self._cache.move_to_end(key)
                    return hit
        if programs is None:
            programs, root = serialize_for_compile(grammar)
        try:
            lowered = self._lower(programs, root)
        except GrammarLimitError as exc:
            raise _named(exc, grammar) from None
        compiled = CompiledGrammar(grammar, self.tokenizer_info, lowered)
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

    @pauses_gc
    def compile_json_schema(self, schema: Any, **kwargs: Any) -> CompiledGrammar:
        """JSON Schema (dict, JSON text, Pydantic model) -> compiled grammar; kwargs go to Grammar.from_json_schema.

        An option it does not take, or one out of range, raises ConfigError naming it.
        """
        unknown = sorted(set(kwargs) - _JSON_SCHEMA_OPTIONS)
        if unknown:
            raise ConfigError(
                f"compile_json_schema got unknown option(s) {', '.join(unknown)}; "
                f"it takes {', '.join(sorted(_JSON_SCHEMA_OPTIONS))}"
            )
        return self.compile(Grammar.from_json_schema(schema, **kwargs))

    @pauses_gc
    def compile_regex(self, pattern: str) -> CompiledGrammar:
        """A Python-syntax regex, matched in full."""
        return self.compile(Grammar.from_regex(pattern))

    @pauses_gc
    def compile_ebnf(self, text: str, *, syntax: str = "gbnf", start: str | None = None) -> CompiledGrammar:
        """GBNF (default) or Lark grammar text."""
        return self.compile(Grammar.from_ebnf(text, syntax=syntax, start=start))

    @pauses_gc
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


def _default_lowering(info: TokenizerInfo) -> Any:
    """Compiles a grammar for ``info`` with the default limits and no cache (for the warm-up)."""

    @pauses_gc
    def lower(grammar: Grammar) -> Any:
        programs, root = serialize_for_compile(grammar)
        return load_native().compile_serialized(
            info._native,
            programs,
            root,
            DEFAULT_MAX_STATES,
            DEFAULT_MAX_COMPILE_SECONDS,
            DEFAULT_MAX_ITEMS_PER_STEP,
            DEFAULT_MAX_WORK_PER_BYTE,
            DEFAULT_MAX_WORK_PER_MASK,
        )

    return lower


def _named(exc: GrammarLimitError, grammar: Grammar) -> GrammarLimitError:
    """``exc`` with a rule index the native lowering named (``rule #N``) replaced by the rule's name."""
    found = re.search(r"rule #(\d+)", str(exc))
    if found is None or int(found.group(1)) >= len(grammar.rules):
        return exc
    name = grammar.rules[int(found.group(1))][0]
    return GrammarLimitError(str(exc).replace(found.group(0), f"rule {name!r}"))
