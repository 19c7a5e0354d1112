"""Helpers for unit-testing grammars: assertions with readable failures and random accepted strings.

``assert_accepts``/``assert_rejects``/``assert_prefix`` run the native matcher when the C++
extension is built (bytes-only vocabulary) and the pure-Python reference recognizer otherwise;
a failure prints the grammar as GBNF and where the text stopped matching.
``strings`` is a Hypothesis strategy of strings the grammar accepts; ``random_strings`` is the
same generator driven by ``random.Random`` for quick use without Hypothesis. A run-time check
(:class:`~agent_infer.grammar.ir.Check`) is drawn from its carriers until the span passes it
(the reference recognizer decides), at most :data:`MAX_CHECK_DRAWS` times per check.
"""

from __future__ import annotations

import json
import random
import textwrap
from collections.abc import Callable
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from agent_infer.errors import (
    ConfigError,
    GrammarDefinitionError,
    GrammarLimitError,
    NativeExtensionMissingError,
)
from agent_infer.grammar.ir import (
    Alt,
    BoundedString,
    CharClass,
    Check,
    Empty,
    Expr,
    Grammar,
    KeyNode,
    KeySet,
    Literal,
    Ref,
    Repeat,
    Seq,
    UniqueItem,
)
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer

if TYPE_CHECKING:
    from hypothesis.strategies import SearchStrategy

__all__ = ["assert_accepts", "assert_prefix", "assert_rejects", "random_strings", "strings", "to_grammar"]

_INF = float("inf")
# Characters after which a drawn string is only completed: the default of ``max_length``.
DEFAULT_MAX_LENGTH = 400
# A grammar whose shortest string is longer than this cannot be drawn from in reasonable time.
MAX_SHORTEST_STRING = 1_000_000
# Expansion steps of one draw before every later choice is the simplest: nested repeats of items
# that draw nothing (``((a?)*)*``) never reach ``max_length`` and would otherwise multiply.
MAX_DRAW_STEPS = 200_000
# Draws of one run-time check's span from its carriers before giving up (GrammarLimitError).
MAX_CHECK_DRAWS = 64


def to_grammar(grammar: Grammar | str, kind: str = "gbnf") -> Grammar:
    """A Grammar as is, or text of ``kind``: ``"gbnf"``, ``"lark"``, ``"regex"`` or ``"json_schema"``."""
    if isinstance(grammar, Grammar):
        return grammar
    if kind == "regex":
        return Grammar.from_regex(grammar)
    if kind == "json_schema":
        return Grammar.from_json_schema(grammar)
    return Grammar.from_ebnf(grammar, syntax=kind)


# --- matching backends ------------------------------------------------------------------------------


@lru_cache(maxsize=1)
def _native_compiler() -> Any:
    """A bytes-only GrammarCompiler, or None when the native extension is unavailable."""
    try:
        from agent_infer.grammar import GrammarCompiler, TokenizerInfo

        compiler = GrammarCompiler(TokenizerInfo.bytes_only())
        compiler.compile(Grammar.choice(["x"]))  # import errors of the extension surface here
    except (ImportError, AttributeError):  # NativeExtensionMissingError is an ImportError
        return None
    return compiler


def _run_native(grammar: Grammar, text: str) -> tuple[int, bool] | None:
    compiler = _native_compiler()
    if compiler is None:
        return None
    from agent_infer.grammar import GrammarMatcher

    matcher = GrammarMatcher(compiler.compile(grammar))
    # Character by character, so a rejection names a character position, not a byte offset.
    for i, ch in enumerate(text):
        if not matcher.accept_string(ch):
            return i, False
    return len(text), bool(matcher.can_terminate())


def _run(grammar: Grammar, text: str, backend: str) -> tuple[int, bool, str]:
    """(viable prefix length, accepted, backend used)."""
    if backend not in ("auto", "native", "reference"):
        raise ConfigError(f"backend must be 'auto', 'native' or 'reference', not {backend!r}")
    if backend != "reference":
        result = _run_native(grammar, text)
        if result is not None:
            return (*result, "native matcher")
        if backend == "native":
            raise NativeExtensionMissingError(
                "the native matcher is not available (agent_infer._native is not built)"
            )
    rec = ReferenceRecognizer(grammar)
    stop = rec.viable_prefix_length(text)
    return stop, stop == len(text) and rec.accepts(text), "reference recognizer"


def _failure(what: str, grammar: Grammar, text: str, stop: int, used: str) -> str:
    where = (
        f"  matching stopped at character {stop}: {text[:stop]!r} <HERE> {text[stop:]!r}"
        if stop < len(text)
        else "  the whole text matched as a prefix but the grammar cannot end there"
    )
    return f"{what} ({used})\n  text: {text!r}\n{where}\n  grammar (GBNF):\n" + textwrap.indent(
        str(grammar), "    "
    )


def assert_accepts(grammar: Grammar | str, text: str, *, kind: str = "gbnf", backend: str = "auto") -> None:
    """Fail unless ``text`` is in the grammar's language."""
    g = to_grammar(grammar, kind)
    stop, ok, used = _run(g, text, backend)
    if not ok:
        raise AssertionError(_failure("grammar rejected the text", g, text, stop, used))


def assert_rejects(grammar: Grammar | str, text: str, *, kind: str = "gbnf", backend: str = "auto") -> None:
    """Fail if ``text`` is in the grammar's language."""
    g = to_grammar(grammar, kind)
    _, ok, used = _run(g, text, backend)
    if ok:
        raise AssertionError(
            f"grammar accepted the text ({used})\n  text: {text!r}\n  grammar (GBNF):\n"
            + textwrap.indent(str(g), "    ")
        )


def assert_prefix(grammar: Grammar | str, text: str, *, kind: str = "gbnf", backend: str = "auto") -> None:
    """Fail unless ``text`` can be extended to a string of the language (a viable prefix)."""
    g = to_grammar(grammar, kind)
    stop, _, used = _run(g, text, backend)
    if stop < len(text):
        raise AssertionError(_failure("text is not a prefix of the language", g, text, stop, used))


# --- generating accepted strings -------------------------------------------------------------------

_PRINTABLE = (0x20, 0x7E)


def _split_ranges(ranges: tuple[tuple[int, int], ...]) -> list[list[tuple[int, int]]]:
    """Buckets (printable ASCII, rest of the BMP, astral), surrogates removed, empty ones dropped."""
    buckets: list[list[tuple[int, int]]] = [[], [], []]
    for lo, hi in ranges:
        for k, (blo, bhi) in enumerate(((0x20, 0x7E), (0, 0xFFFF), (0x10000, 0x10FFFF))):
            a, b = max(lo, blo), min(hi, bhi)
            if a > b:
                continue
            pieces = [(a, b)]
            if k == 1:  # the BMP bucket: skip printable ASCII (bucket 0) and surrogates
                pieces = [
                    (max(x, pa), min(y, pb))
                    for x, y in pieces
                    for pa, pb in ((0, 0x1F), (0x7F, 0xD7FF), (0xE000, 0xFFFF))
                    if max(x, pa) <= min(y, pb)
                ]
            buckets[k].extend(pieces)
    return [b for b in buckets if b]


class _Chooser:
    """Where choices come from: ``integer(lo, hi)`` inclusive. Smaller is simpler (shrinks first)."""

    def __init__(self, integer: Callable[[int, int], int]) -> None:
        self.integer = integer

    def char(self, ranges: tuple[tuple[int, int], ...]) -> str:
        buckets = _split_ranges(ranges)
        if not buckets:
            raise GrammarDefinitionError("a character class only matches surrogates; cannot draw from it")
        # Weights 7:2:1 over the buckets present, by a draw in 0..9 so that 0 (ASCII) is the shrink target.
        weights = [7, 2, 1][: len(buckets)]
        roll = self.integer(0, sum(weights) - 1)
        k = 0
        while roll >= weights[k]:
            roll -= weights[k]
            k += 1
        bucket = buckets[k]
        index = self.integer(0, sum(hi - lo + 1 for lo, hi in bucket) - 1)
        for lo, hi in bucket:
            if index <= hi - lo:
                return chr(lo + index)
            index -= hi - lo + 1
        raise AssertionError("index within bucket size")


_FIRST = _Chooser(lambda lo, hi: lo)  # every choice its simplest: completes a draw without drawing
# Draws of a bounded string before its simplest expansion is taken.
_BOUNDED_DRAWS = 8


def _decoded_length(text: str) -> float:
    """The code points of the JSON string ``text`` (quotes included) once decoded; infinite when
    it does not decode."""
    try:
        value = json.loads(text)
    except ValueError:
        return _INF
    return len(value) if isinstance(value, str) else _INF


class _Generator:
    """Random expansion of the IR with a depth budget that always lets recursion terminate.

    ``height`` is the fewest nested rule references any derivation of a node needs (a fixed point
    over the rules). A node is only chosen when its height fits the remaining depth, and the
    budget starts at the root's height plus ``max_depth``, so a valid choice always exists.
    Once ``max_length`` characters are out, every later choice is the simplest one (the
    shallowest alternative, the fewest repetitions) and draws nothing: nested repeats and
    recursion otherwise grow a draw exponentially with ``max_depth``.
    """

    def __init__(self, grammar: Grammar, max_repeat: int, max_depth: int, max_length: int) -> None:
        if max_length < 0:
            raise ConfigError(f"max_length must be non-negative, not {max_length}")
        # Key tries (only ever whole rule bodies) are drawn from as the alternations they expand to,
        # a unique array item or a bounded string as its item: a drawn array may repeat an item of
        # a uniqueItems array (the draw does not track an array's items), which the grammar then
        # rejects; a bounded string is drawn again while it passes its bound.
        self.bounds = {
            name: body.max_length for name, body in grammar.rules if isinstance(body, BoundedString)
        }
        self.rules = {
            name: Alt(body.expand())
            if isinstance(body, KeySet | KeyNode)
            else body.item
            if isinstance(body, UniqueItem | BoundedString)
            else body
            for name, body in grammar.rules
        }
        self.grammar = grammar
        self.check_judges: dict[str, Callable[[str], bool]] = {}
        self.root = grammar.root
        self.max_repeat = max_repeat
        self.max_depth = max_depth
        self.max_length = max_length
        self.size = 0  # characters out in the current draw
        self.rule_height: dict[str, float] = {name: _INF for name in self.rules}
        self.rule_length: dict[str, float] = {name: _INF for name in self.rules}
        changed = True
        while changed:  # fixed point: fewest nested references / fewest characters per rule
            changed = False
            for name, expr in self.rules.items():
                h, n = self._height(expr), self._length(expr)
                if h < self.rule_height[name] or n < self.rule_length[name]:
                    self.rule_height[name] = min(h, self.rule_height[name])
                    self.rule_length[name] = min(n, self.rule_length[name])
                    changed = True
        if self.rule_height[self.root] == _INF:
            raise GrammarDefinitionError(f"grammar rooted at {self.root!r} accepts no string")
        shortest = self.rule_length[self.root]
        if shortest > MAX_SHORTEST_STRING:
            raise GrammarLimitError(
                f"the grammar's shortest string has {shortest:.0f} characters; strings are drawn"
                f" only from grammars whose shortest string has at most {MAX_SHORTEST_STRING}"
            )
        self.steps = 0  # expansion steps in the current draw
        # Keyed by node identity (the rules keep every node alive): hashing a frozen IR node walks
        # its whole subtree.
        self.memo: dict[int, float] = {}
        # Alternatives sorted simplest first, so Hypothesis shrinks toward the simplest choice.
        self.order: dict[int, list[Expr]] = {}

    def _length(self, expr: Expr) -> float:
        if isinstance(expr, Check):
            return self._length(Alt(expr.items[: expr.carriers]))
        if isinstance(expr, Empty):
            return 0
        if isinstance(expr, Literal):
            return len(expr.text)
        if isinstance(expr, CharClass):
            return 1 if _split_ranges(expr.normalized()) else _INF
        if isinstance(expr, Ref):
            return self.rule_length[expr.name]
        if isinstance(expr, Seq):
            return sum(self._length(e) for e in expr.items)
        if isinstance(expr, Alt):
            return min((self._length(e) for e in expr.items), default=_INF)
        if isinstance(expr, Repeat):
            return 0 if expr.min == 0 else expr.min * self._length(expr.item)
        raise TypeError(f"not an IR node: {expr!r}")

    def _height(self, expr: Expr) -> float:
        if isinstance(expr, Check):
            return self._height(Alt(expr.items[: expr.carriers]))
        if isinstance(expr, Empty | Literal):
            return 0
        if isinstance(expr, CharClass):
            return 0 if _split_ranges(expr.normalized()) else _INF
        if isinstance(expr, Ref):
            return 1 + self.rule_height[expr.name]
        if isinstance(expr, Seq):
            return max((self._height(e) for e in expr.items), default=0)
        if isinstance(expr, Alt):
            return min((self._height(e) for e in expr.items), default=_INF)
        if isinstance(expr, Repeat):
            return 0 if expr.min == 0 else self._height(expr.item)
        raise TypeError(f"not an IR node: {expr!r}")

    def height(self, expr: Expr) -> float:
        found = self.memo.get(id(expr))
        if found is None:
            found = self.memo[id(expr)] = self._height(expr)
        return found

    def generate(self, chooser: _Chooser) -> str:
        out: list[str] = []
        self.size = 0
        self.steps = 0
        self._expand(Ref(self.root), self.height(Ref(self.root)) + self.max_depth, chooser, out)
        return "".join(out)

    def _expand(self, expr: Expr, budget: float, chooser: _Chooser, out: list[str]) -> None:
        self.steps += 1
        if self.size >= self.max_length or self.steps > MAX_DRAW_STEPS:
            chooser = _FIRST
        if isinstance(expr, Literal):
            out.append(expr.text)
            self.size += len(expr.text)
        elif isinstance(expr, CharClass):
            out.append(chooser.char(expr.normalized()))
            self.size += 1
        elif isinstance(expr, Ref) and isinstance(self.rules[expr.name], Check):
            self._expand_check(expr.name, budget - 1, chooser, out)
        elif isinstance(expr, Ref):
            bound = self.bounds.get(expr.name)
            if bound is None:
                self._expand(self.rules[expr.name], budget - 1, chooser, out)
                return
            at, size = len(out), self.size
            for attempt in range(_BOUNDED_DRAWS + 1):
                del out[at:]
                self.size = size
                self._expand(
                    self.rules[expr.name], budget - 1, chooser if attempt < _BOUNDED_DRAWS else _FIRST, out
                )
                if _decoded_length("".join(out[at:])) <= bound:
                    break
        elif isinstance(expr, Seq):
            for item in expr.items:
                self._expand(item, budget, chooser, out)
        elif isinstance(expr, Alt):
            order = self.order.get(id(expr))
            if order is None:
                key = lambda e: (self.height(e), self._length(e))  # noqa: E731
                order = self.order[id(expr)] = sorted(expr.items, key=key)
            fits = [e for e in order if self.height(e) <= budget]
            self._expand(fits[chooser.integer(0, len(fits) - 1)], budget, chooser, out)
        elif isinstance(expr, Repeat):
            hi = expr.min + self.max_repeat if expr.max is None else min(expr.max, expr.min + self.max_repeat)
            if self.height(expr.item) > budget:
                hi = expr.min  # only reachable with min == 0: the item cannot fit, so take none
            for _ in range(chooser.integer(expr.min, hi)):
                done = self.size >= self.max_length or self.steps > MAX_DRAW_STEPS
                self._expand(expr.item, budget, _FIRST if done else chooser, out)

    def _expand_check(self, name: str, budget: float, chooser: _Chooser, out: list[str]) -> None:
        """A span of the check rule ``name``: drawn from its carriers until the check passes."""
        judge = self.check_judges.get(name)
        if judge is None:
            rec = ReferenceRecognizer(Grammar((("root-span", Ref(name)), *self.grammar.rules), "root-span"))
            judge = self.check_judges[name] = rec.accepts
        check = self.rules[name]
        assert isinstance(check, Check)
        for _ in range(MAX_CHECK_DRAWS):
            span: list[str] = []
            size = self.size
            self._expand(Alt(check.items[: check.carriers]), budget, chooser, span)
            if judge("".join(span)):
                out.extend(span)
                return
            self.size = size
        raise GrammarLimitError(f"no string of {MAX_CHECK_DRAWS} drawn for run-time check {name!r} passed it")


def strings(
    grammar: Grammar | str,
    *,
    kind: str = "gbnf",
    max_repeat: int = 5,
    max_depth: int = 8,
    max_length: int = DEFAULT_MAX_LENGTH,
) -> SearchStrategy[str]:
    """A Hypothesis strategy of strings ``grammar`` accepts.

    Unbounded repeats draw at most ``max_repeat`` extra items; rule nesting goes at most
    ``max_depth`` levels beyond the shallowest derivation. Once a string has ``max_length``
    characters (default :data:`DEFAULT_MAX_LENGTH`) the rest is its simplest completion, so a
    string exceeds ``max_length`` only by what the grammar needs to close what is open; shorter
    strings are drawn as without the bound. Likewise after :data:`MAX_DRAW_STEPS` expansion steps
    (nested repeats of items that may be empty). A grammar whose shortest string is longer than
    :data:`MAX_SHORTEST_STRING` raises ``GrammarLimitError``. Draws shrink toward the simplest alternative
    (shallowest, then shortest), the fewest repetitions and printable ASCII. A string the matcher
    counts (``BoundedString``) is drawn again while it passes its bound (8 times, then its simplest
    expansion). The exceptions to "accepts": an array whose items must be distinct
    (``uniqueItems``) may be drawn with a repeated item, and a bounded string whose simplest
    expansion passes its bound is drawn anyway; the grammar rejects both.
    """
    from hypothesis import strategies as st

    gen = _Generator(to_grammar(grammar, kind), max_repeat, max_depth, max_length)

    @st.composite
    def _strings(draw: Any) -> str:
        return gen.generate(_Chooser(lambda lo, hi: draw(st.integers(lo, hi))))

    return _strings()


def random_strings(
    grammar: Grammar | str,
    n: int,
    seed: int = 0,
    *,
    kind: str = "gbnf",
    max_repeat: int = 5,
    max_depth: int = 8,
    max_length: int = DEFAULT_MAX_LENGTH,
) -> list[str]:
    """``n`` pseudo-random strings ``grammar`` accepts (with :func:`strings`' exceptions), reproducible
    from ``seed`` (no Hypothesis); ``max_length`` bounds them as in :func:`strings`."""
    gen = _Generator(to_grammar(grammar, kind), max_repeat, max_depth, max_length)
    rng = random.Random(seed)
    chooser = _Chooser(rng.randint)
    return [gen.generate(chooser) for _ in range(n)]
