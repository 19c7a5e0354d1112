"""Rule naming and counted repeats for the JSON Schema lowering: the :class:`RuleWriter` half of
:class:`~agent_infer.grammar.frontends.json_schema.compiler.Compiler` that adds rules under fresh valid
names, shares equal bodies, and writes ``item{lo,hi}`` with chunks or doubling rules."""

from __future__ import annotations

import functools
import re
import time

from agent_infer.errors import GrammarLimitError
from agent_infer.grammar.common.memo import register_cache
from agent_infer.grammar.frontends.json_schema.keys.complement_keys import KEY_RULE_PREFIX, SPECIAL_RULE
from agent_infer.grammar.frontends.json_schema.types.string_encoding import HIGH_RULE
from agent_infer.grammar.ir import Alt, Empty, Expr, Ref, Repeat, alt, opt, seq

MAX_RULES = 50_000
MAX_INLINE_REPEAT = 32
# Chunked repeats (Compiler._chunked) up to this many chunks; longer ones use doubling rules.
MAX_CHUNKS = 256

_RESERVED = frozenset(("root", "ws", "char", HIGH_RULE, SPECIAL_RULE))
# The body a rule name holds between Compiler.fresh and its real body (the empty language).
_UNBUILT = Alt(())
# Names of the rules whose bodies are process-wide IR objects (only they start with it: fresh names
# come from _rule_base, and a JSON pointer hint never starts with "char").
SHARED_RULE_PREFIX = "char"
_NON_NAME = re.compile(r"[^A-Za-z0-9_-]+")
_NAME_CHARS = re.compile(r"[A-Za-z0-9_-]*")
_RULE_BASE_SCAN = 64


@functools.lru_cache(maxsize=1 << 14)
def _rule_base(hint: str) -> str:
    """The rule-name stem of ``hint``: runs of other characters become ``-``, at most 40 characters."""
    if len(hint) > _RULE_BASE_SCAN:
        # Deep pointers are long and only the last 40 characters are kept: rewrite a tail of the
        # hint. Runs map to one "-" each, so that tail's rewrite is a suffix of the whole one,
        # and once its core (between the outer "-") exceeds 40 characters its last 40 are the
        # whole rewrite's.
        core = _dashes(hint[-_RULE_BASE_SCAN:]).strip("-")
        base = core[-40:] if len(core) > 40 else _dashes(hint).strip("-")[-40:] or "s"
    else:
        base = _dashes(hint).strip("-")[-40:] or "s"
    # The shared key-trie rules own their prefix (keys/complement_keys.py): keep other names out of it.
    return "s-" + base if base.startswith(KEY_RULE_PREFIX) else base


def _dashes(text: str) -> str:
    """``_NON_NAME.sub("-", text)``. Most hints are pointers of name characters, single ``/`` and
    ``.``: two replaces and a match instead of the substitution (~40 % of its cost)."""
    if "//" not in text and ".." not in text and "/." not in text and "./" not in text:
        out = text.replace("/", "-").replace(".", "-")
        if _NAME_CHARS.fullmatch(out):
            return out
    return _NON_NAME.sub("-", text)


class RuleWriter:
    """The rule table of a lowering (``rules``, set up by the Compiler) and how rules join it."""

    rules: dict[str, Expr]
    # time.perf_counter() past which adding a rule raises GrammarLimitError (set by the Compiler).
    deadline: float = float("inf")
    max_seconds: float = float("inf")
    _blocks: dict[Expr, list[str]]
    _shared: dict[Expr, str]
    _next_suffix: dict[str, int]

    def repeat(self, item: Expr, lo: int, hi: int | None, inline_limit: int = MAX_INLINE_REPEAT) -> Expr:
        """``item{lo,hi}``; counts above ``inline_limit`` use chunks or binary "doubling" rules.

        A limit above MAX_INLINE_REPEAT (string characters) asks for ``inline_limit``-item chunks
        (``_chunked``) when at most MAX_CHUNKS of them are needed.

        Matchers expand counted repeats into automaton states, so ``{0,32767}`` would be 32K
        copies. With ``E_k`` = exactly 2^k items (``E_k ::= E_(k-1) E_(k-1)``) and ``U_k`` = fewer
        than 2^k items (``U_k ::= E_(k-1)? U_(k-1)``), any bound needs O(log n) small rules, and every
        length has exactly one parse (its binary representation).
        """
        if hi == 0:
            return Empty()
        if (hi if hi is not None else lo) <= inline_limit:
            return Repeat(item, lo, hi)
        if inline_limit > MAX_INLINE_REPEAT and hi is not None and lo <= inline_limit:
            if hi - lo < inline_limit:
                return Repeat(item, lo, hi)
            if (hi - lo) // inline_limit <= MAX_CHUNKS:
                return self._chunked(item, lo, hi, inline_limit)
        head = self._exactly(item, lo)
        if hi is None:
            return seq(head, Repeat(item, 0, None))
        return seq(head, self._up_to(item, hi - lo))

    def _chunked(self, item: Expr, lo: int, hi: int, size: int) -> Expr:
        """``item{lo,hi}`` as ``lo`` items, then whole chunks of ``size`` items (one shared rule)
        and a counted tail: every position is a uniform chain position (see grammar/mask/short_tokens.cpp),
        and the length after the head, ``a * size + b`` with ``b < size``, has exactly one parse.
        """
        block = self.shared_rule("chunk", Repeat(item, size, size))
        q, r = divmod(hi - lo, size)
        fewer = seq(Repeat(block, 0, q - 1) if q > 1 else Empty(), Repeat(item, 0, size - 1))
        full = seq(Repeat(block, q, q) if q > 1 else block, Repeat(item, 0, r) if r else Empty())
        return seq(Repeat(item, lo, lo) if lo else Empty(), alt(fewer, full))

    def _power(self, item: Expr, k: int) -> Expr:
        """E_k: exactly 2^k copies of ``item`` (a shared rule)."""
        names = self._blocks.setdefault(item, [])
        while len(names) <= k:
            body = item if not names else seq(Ref(names[-1]), Ref(names[-1]))
            names.append(self.add_rule(f"pow{len(names)}", body))
        return Ref(names[k])

    def _exactly(self, item: Expr, n: int) -> Expr:
        return seq(*(self._power(item, k) for k in range(n.bit_length() - 1, -1, -1) if n >> k & 1))

    def _up_to(self, item: Expr, n: int) -> Expr:
        """0..n copies: fewer than 2^k (k = top bit), or 2^k followed by 0..n-2^k."""
        if n == 0:
            return Empty()
        k = n.bit_length() - 1
        below = seq(*(opt(self._power(item, i)) for i in range(k - 1, -1, -1)))
        return alt(below, seq(self._power(item, k), self._up_to(item, n - (1 << k))))

    def shared_rule(self, hint: str, expr: Expr) -> Ref:
        """A reference to one rule per distinct ``expr``, so that equal expressions share states."""
        name = self._shared.get(expr)
        if name is None:
            name = self._shared[expr] = self.add_rule(hint, expr)
        return Ref(name)

    def add_rule(self, hint: str, expr: Expr) -> str:
        """Add a rule with a fresh name derived from ``hint``."""
        name = self.fresh(hint)
        self.rules[name] = expr
        return name

    def tail_rule(self, expr: Expr) -> str:
        """``add_rule("obj-tail", expr)``: objects ask for hundreds (the hint needs no rewrite)."""
        # _fresh_from(_TAIL_BASE) written out: one Python call per tail instead of two.
        rules = self.rules
        if len(rules) >= MAX_RULES:
            raise GrammarLimitError(f"JSON Schema grammar exceeds {MAX_RULES} rules")
        if time.perf_counter() > self.deadline:
            self._out_of_time()
        k = self._next_suffix.get(_TAIL_BASE, 1)
        name = _TAIL_BASE if k == 1 else f"{_TAIL_BASE}-{k}"
        while name in rules or name in _RESERVED:
            k += 1
            name = f"{_TAIL_BASE}-{k}"
        self._next_suffix[_TAIL_BASE] = k + 1
        rules[name] = expr
        return name

    def fresh(self, hint: str) -> str:
        """A fresh, valid rule name derived from ``hint``."""
        return self._fresh_from(_rule_base(hint))

    def _out_of_time(self) -> None:
        raise GrammarLimitError(
            f"JSON Schema lowering exceeded its time limit of {self.max_seconds:g} s after {len(self.rules)} "
            "rules (AGENT_INFER_JSON_SCHEMA_MAX_SECONDS)"
        )

    def _fresh_from(self, base: str) -> str:
        if len(self.rules) >= MAX_RULES:
            raise GrammarLimitError(f"JSON Schema grammar exceeds {MAX_RULES} rules")
        if time.perf_counter() > self.deadline:
            self._out_of_time()
        # Names are only ever added, so every suffix below the one after the last taken for
        # ``base`` is still taken: resume the search there (the smallest free suffix, as a scan
        # from 1 finds).
        k = self._next_suffix.get(base, 1)
        name = base if k == 1 else f"{base}-{k}"
        rules = self.rules
        while name in rules or name in _RESERVED:
            k += 1
            name = f"{base}-{k}"
        self._next_suffix[base] = k + 1
        rules[name] = _UNBUILT  # reserve; replaced when the body is built
        return name


_TAIL_BASE = "obj-tail"  # its own _rule_base (name characters only, outside the key-trie prefix)

register_cache(_rule_base)
