"""GrammarCompiler: lowers IR grammars to native byte automata for one tokenizer, with an LRU cache."""

from __future__ import annotations

import hashlib
import itertools
import threading
from array import array
from collections import OrderedDict
from typing import Any

from agent_infer.errors import ConfigError, GrammarDefinitionError, GrammarLimitError
from agent_infer.grammar.compile.caches import register_cache
from agent_infer.grammar.compile.gc_pause import pauses_gc
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.frontends.json_schema.keys.key_set import KeySet
from agent_infer.grammar.frontends.json_schema.keys.key_trie import KeyNode
from agent_infer.grammar.ir import Alt, CharClass, Empty, Expr, Grammar, Literal, Ref, Repeat, Seq
from agent_infer.native import load_native, optional_native

# Opcodes shared with engine_native/src/grammar.h (enum Op).
_EMPTY, _LITERAL, _CLASS, _SEQ, _ALT, _REPEAT, _REF = range(7)
_INT32_MAX = 2**31 - 1

DEFAULT_MAX_STATES = 500_000
DEFAULT_MAX_COMPILE_SECONDS = 30.0
DEFAULT_MAX_ITEMS_PER_STEP = 200_000
# Grammar.from_json_schema's keyword options (compile_json_schema passes them on).
_JSON_SCHEMA_OPTIONS = frozenset(("strict", "whitespace", "max_whitespace", "indent", "remotes"))
# Matching work (Earley items added plus origin-set items scanned by completions) for one
# accepted byte, and for all the Earley steps of one mask fill (or one shortest completion).
DEFAULT_MAX_WORK_PER_BYTE = 1_000_000
DEFAULT_MAX_WORK_PER_MASK = 16_000_000


def _serialize_expr(expr: Expr, index: dict[str, int], out: list[int]) -> None:
    """Append the prefix encoding of ``expr`` (see grammar.h) to ``out`` (iteratively, any depth)."""
    stack: list[Expr] = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, Literal | CharClass):
            out.extend(_leaf(node))
        elif isinstance(node, Seq | Alt):
            out.append(_SEQ if isinstance(node, Seq) else _ALT)
            out.append(len(node.items))
            stack.extend(reversed(node.items))
        elif isinstance(node, Repeat):
            out.extend(_repeat_head(node))
            stack.append(node.item)
        elif isinstance(node, Ref):
            out.append(_REF)
            out.append(index[node.name])
        elif isinstance(node, Empty):
            out.append(_EMPTY)
        else:
            raise GrammarDefinitionError(f"not an IR node: {node!r}")


# Literal programs by text: keys, punctuation and keywords recur across rules and grammars.
_LITERAL_CHUNKS: dict[str, tuple[int, ...]] = {}
_MAX_LITERAL_CHUNKS = 1 << 16


def _leaf(node: Literal | CharClass) -> tuple[int, ...]:
    """The program of a Literal or CharClass node (cached: on the class node, by text for literals)."""
    if isinstance(node, CharClass):
        chunk = node._program
        if chunk is None:
            ranges = node.normalized()
            chunk = (_CLASS, len(ranges), *(x for pair in ranges for x in pair))
            object.__setattr__(node, "_program", chunk)
        return chunk
    text = node.text
    chunk = _LITERAL_CHUNKS.get(text)
    if chunk is None:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            raise GrammarDefinitionError(
                f"literal {text!r} contains a lone surrogate, which has no UTF-8 encoding"
            ) from None
        chunk = (_LITERAL, len(data), *data)
        if len(_LITERAL_CHUNKS) >= _MAX_LITERAL_CHUNKS:
            _LITERAL_CHUNKS.clear()
        _LITERAL_CHUNKS[text] = chunk
    return chunk


def _repeat_head(node: Repeat) -> tuple[int, int, int]:
    if node.min > _INT32_MAX or (node.max is not None and node.max > _INT32_MAX):
        raise GrammarLimitError(f"repeat bounds {{{node.min},{node.max}}} are too large")
    return (_REPEAT, node.min, -1 if node.max is None else node.max)


class _Serializer:
    """Programs of one grammar's rules. A composite node met again (subtrees are shared within and
    between rules) copies the slice its first occurrence wrote instead of being walked again."""

    def __init__(self, index: dict[str, int]) -> None:
        self.index = index
        self.refs = {name: (_REF, i) for name, i in index.items()}
        self.programs: list[list[int]] = []
        # id(node) -> where its first occurrence was written, packed into one int as
        # rule << 64 | start << 32 | end: ints are not tracked by the cyclic GC, tuples would be.
        self.spans: dict[int, int] = {}
        self.rule = 0

    def emit(self, node: Expr, out: list[int]) -> None:
        kind = type(node)
        if kind is Literal or kind is CharClass:
            out.extend(_leaf(node))  # type: ignore[arg-type]
            return
        if kind is Ref:
            out.extend(self.refs[node.name])  # type: ignore[attr-defined]
            return
        if kind is Empty:
            out.append(_EMPTY)
            return
        span = self.spans.get(id(node))
        if span is not None:
            out.extend(self.programs[span >> 64][(span >> 32) & 0xFFFFFFFF : span & 0xFFFFFFFF])
            return
        start = len(out)
        if kind is Seq or kind is Alt:
            items = node.items  # type: ignore[attr-defined]
            out.extend((_SEQ if kind is Seq else _ALT, len(items)))
            emit, refs, literals = self.emit, self.refs, _LITERAL_CHUNKS
            # Leaves and references are most children: handled inline, without a call.
            for item in items:
                k = type(item)
                if k is Literal:
                    out.extend(literals.get(item.text) or _leaf(item))
                elif k is Ref:
                    out.extend(refs[item.name])
                elif k is CharClass:
                    out.extend(item._program or _leaf(item))
                else:
                    emit(item, out)
        elif kind is Repeat:
            out.extend(_repeat_head(node))  # type: ignore[arg-type]
            self.emit(node.item, out)  # type: ignore[attr-defined]
        else:
            _serialize_expr(node, self.index, out)  # subclasses and foreign nodes: the general path
        self.spans[id(node)] = self.rule << 64 | start << 32 | len(out)

    def rule_program(self, expr: Expr) -> list[int]:
        """Serialize the next rule's body (rules go in grammar order)."""
        code: list[int] = []
        self.rule = len(self.programs)
        self.programs.append(code)
        if type(expr) is KeySet:  # a whole key trie: one instruction (nested, the expansion below)
            code.extend(expr.program(self.index))
            return code
        try:
            self.emit(expr, code)
        except RecursionError:
            # Nesting deeper than the interpreter's stack: the iterative walk writes the same program.
            code.clear()
            self.spans = {k: v for k, v in self.spans.items() if v >> 64 != self.rule}
            _serialize_expr(expr, self.index, code)
        return code


# The order serialize_rules expects; KeyNode bodies (key-trie nodes) are written from their spec,
# KeySet bodies (whole key tries) as one KEY_TRIE instruction from their names.
_KINDS = (Empty, Literal, CharClass, Seq, Alt, Repeat, Ref, KeyNode, KeySet)


def serialize_grammar(grammar: Grammar) -> tuple[list[list[int]], int]:
    """Flat per-rule integer programs and the root's rule index."""
    index = {name: i for i, (name, _) in enumerate(grammar.rules)}
    native = optional_native("serialize_rules")
    if native:
        # The same programs, written in C++; None for anything it leaves to the Python path
        # below (foreign node types, literals with lone surrogates, out-of-range bounds...).
        programs = native([expr for _, expr in grammar.rules], index, _KINDS)
        if programs is not None:
            return programs, index[grammar.root]
    return serialize_grammar_python(grammar, index)


def serialize_grammar_python(
    grammar: Grammar, index: dict[str, int] | None = None
) -> tuple[list[list[int]], int]:
    """:func:`serialize_grammar` without the native fast path (the reference it must match)."""
    if index is None:
        index = {name: i for i, (name, _) in enumerate(grammar.rules)}
    ser = _Serializer(index)
    for name, expr in grammar.rules:
        try:
            ser.rule_program(expr)
        except KeyError as exc:  # Grammar.unchecked skips the validation that reports this earlier
            raise GrammarDefinitionError(f"rule {name!r} refers to undefined rule {exc.args[0]!r}") from None
    return ser.programs, index[grammar.root]


def _serialize_for_compile(grammar: Grammar) -> tuple[Any, int]:
    """The rule programs in the form the native compiler takes, and the root's index: native
    ``SerializedRules`` (never converted to Python ints) when the extension serializes the
    grammar, else the Python serializer's lists."""
    packed = _native_packer()
    if packed:
        # A front end may name rules whose bodies it shares across grammars (``_shared_prefix``):
        # their programs are then cached natively by body object. The native side builds the rule
        # index from the pairs, and takes the IR it walks out of the cyclic GC (IR trees hold no
        # cycles), so the first collection after this compile does not walk the whole grammar.
        found = packed(grammar.rules, grammar.root, _KINDS, getattr(grammar, "_shared_prefix", None))
        if found is not None:
            return found[0], found[1]
    return serialize_grammar_python(grammar)


def _native_packer() -> Any:
    """``_native.serialize_grammar_packed`` when the build also has ``compile_serialized``, else False."""
    return optional_native("serialize_grammar_packed") if optional_native("compile_serialized") else False


def _program_bytes(programs: Any) -> bytes:
    """Rule count, program lengths and words as int32 bytes, for either form of the programs."""
    if not isinstance(programs, list):
        return bytes(programs.tobytes())
    flat = array("i", [len(programs)])
    flat.extend(len(p) for p in programs)
    flat.extend(itertools.chain.from_iterable(programs))
    return flat.tobytes()


def _program_key(grammar: Grammar, programs: Any, root: int) -> str:
    """The compile-cache key: a digest of the rule names and programs, which determine the automata.

    Hashing the programs the compile needs anyway costs a few ms for a 3 000-rule schema where
    printing the grammar for :meth:`Grammar.fingerprint` took ~30 ms. Grammars with equal keys
    print alike, up to how a character class is written (``[^...]`` or its ranges).
    """
    digest = hashlib.sha256()
    digest.update(f"{root}\n{len(grammar.rules)}\n".encode())
    digest.update("\x00".join(name for name, _ in grammar.rules).encode())
    digest.update(_program_bytes(programs))
    return digest.hexdigest()


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

    @pauses_gc
    def compile(self, grammar: Grammar) -> CompiledGrammar:
        """Compile an IR grammar (cached). Raises GrammarDefinitionError for an empty language."""
        programs: Any = None
        key = ""
        if self._cache_enabled:
            key = getattr(grammar, "_compile_key", "")
            if not key:
                programs, root = _serialize_for_compile(grammar)
                key = _program_key(grammar, programs, root)
                # Grammars are immutable: the key is kept on the instance, so a grammar compiled
                # again (the engine reuses lowered grammars across requests) costs a dict lookup.
                object.__setattr__(grammar, "_compile_key", key)
            with self._lock:
                hit = self._cache.get(key)
                if hit is not None:
                    self._cache.move_to_end(key)
                    return hit
        if programs is None:
            programs, root = _serialize_for_compile(grammar)
        ext = load_native()
        make = ext.CompiledGrammar if isinstance(programs, list) else ext.compile_serialized
        native = make(
            self.tokenizer_info._native,
            programs,
            root,
            self._max_states,
            self._max_seconds,
            self._max_items,
            *self._max_work,
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


register_cache(_LITERAL_CHUNKS)
