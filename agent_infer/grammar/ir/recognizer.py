"""A slow, obviously-correct recognizer over the IR: the meaning of a grammar, run directly.

The grammar is lowered to plain BNF over code-point-set terminals and run through an Earley
parser (with the Aycock-Horspool fix for nullable rules), so left recursion, nullable rules and
ambiguity all work. Unproductive rules are pruned first, which makes "the Earley set is
non-empty" exactly "the text is a prefix of some word of the language".

It is the test oracle for the matcher and the front ends, and it has three run-time users, each
deciding whether one short text is in a grammar where no tokenizer is at hand:

* the JSON Schema front end, for value checks: whether a concrete JSON value (an ``enum`` or
  ``const`` member next to other keywords, a value two ``oneOf`` branches might share) satisfies
  a sub-schema that its type alone does not decide, by lowering that sub-schema and recognizing
  the value's compact JSON text (``Compiler.value_matcher``);
* ``agent_infer.tools``, to validate a spec-only tool's arguments when ``jsonschema`` is not
  installed;
* ``agent_infer.testing``, as the backend of ``assert_accepts`` and friends on request
  (``backend="reference"``) or without the native extension.

Cost: building the recognizer is linear in the grammar's size (no automata, no tokenizer tables);
recognizing is an Earley parse in Python, about a millisecond per value for a typical sub-schema
(cubic in the text's length in the worst case), so it is only used on short texts, and the front
end decides values by their type alone where it can.
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections import defaultdict
from decimal import Decimal
from fractions import Fraction
from typing import Any

from agent_infer.grammar.ir.grammar import Grammar
from agent_infer.grammar.ir.nodes import (
    Alt,
    BoundedString,
    CharClass,
    Empty,
    Expr,
    KeyNode,
    KeySet,
    Literal,
    Ref,
    Repeat,
    Seq,
    UniqueItem,
)

_Item = tuple[int, int, int]  # (production index, dot, origin)


class _Terminal:
    """A set of code points as sorted, merged, inclusive ranges."""

    __slots__ = ("his", "los")

    def __init__(self, ranges: tuple[tuple[int, int], ...]) -> None:
        self.los = [lo for lo, _ in ranges]
        self.his = [hi for _, hi in ranges]

    def __contains__(self, cp: int) -> bool:
        k = bisect_right(self.los, cp) - 1
        return k >= 0 and cp <= self.his[k]


class _Lowering:
    """IR -> BNF productions. Nonterminals are ints >= 0; terminal k is the symbol ``-(k + 1)``."""

    def __init__(self, grammar: Grammar) -> None:
        self.prods: list[tuple[int, tuple[int, ...]]] = []
        self.terminals: list[_Terminal] = []
        self.n_nt = 0
        self.rule_nt = {name: self.new_nt() for name, _ in grammar.rules}
        # Nonterminals of UniqueItem rule bodies: their completions are checked against the text.
        self.unique: set[int] = {
            self.rule_nt[name] for name, expr in grammar.rules if isinstance(expr, UniqueItem)
        }
        # Nonterminals of BoundedString rule bodies: their completions decode to at most n characters.
        self.bounded: dict[int, int] = {
            self.rule_nt[name]: expr.max_length
            for name, expr in grammar.rules
            if isinstance(expr, BoundedString)
        }
        self.memo: dict[Expr, int] = {}
        self.term_memo: dict[tuple[tuple[int, int], ...], int] = {}
        self.start = self.new_nt()
        self.prods.append((self.start, (self.rule_nt[grammar.root],)))
        for name, expr in grammar.rules:
            body = expr.item if isinstance(expr, UniqueItem | BoundedString) else expr
            self.prods.append((self.rule_nt[name], self.symbols(body)))

    def new_nt(self) -> int:
        self.n_nt += 1
        return self.n_nt - 1

    def terminal(self, ranges: tuple[tuple[int, int], ...]) -> int:
        if ranges not in self.term_memo:
            self.terminals.append(_Terminal(ranges))
            self.term_memo[ranges] = -len(self.terminals)
        return self.term_memo[ranges]

    def symbols(self, expr: Expr) -> tuple[int, ...]:
        if isinstance(expr, Empty):
            return ()
        if isinstance(expr, Literal):
            return tuple(self.terminal(((ord(c), ord(c)),)) for c in expr.text)
        if isinstance(expr, CharClass):
            return (self.terminal(expr.normalized()),)
        if isinstance(expr, Ref):
            return (self.rule_nt[expr.name],)
        if isinstance(expr, Seq):
            return tuple(s for item in expr.items for s in self.symbols(item))
        if isinstance(expr, Alt | Repeat | KeySet | KeyNode):
            return (self.nonterminal(expr),)
        if isinstance(expr, UniqueItem | BoundedString):
            raise TypeError(f"a {type(expr).__name__} is only allowed as a whole rule body")
        raise TypeError(f"not an IR node: {expr!r}")

    def nonterminal(self, expr: Alt | Repeat | KeySet | KeyNode) -> int:
        if expr in self.memo:
            return self.memo[expr]
        nt = self.memo[expr] = self.new_nt()
        if not isinstance(expr, Repeat):
            for item in expr.items if isinstance(expr, Alt) else expr.expand():
                self.prods.append((nt, self.symbols(item)))
            return nt
        body = self.symbols(expr.item)
        # The optional tail: unbounded `T -> e | body T`, bounded a chain of k optional copies.
        if expr.max is None:
            tail = self.new_nt()
            self.prods += [(tail, ()), (tail, (*body, tail))]
        else:
            tail = self.new_nt()
            self.prods.append((tail, ()))
            for _ in range(expr.max - expr.min):
                longer = self.new_nt()
                self.prods += [(longer, ()), (longer, (*body, tail))]
                tail = longer
        self.prods.append((nt, (*body * expr.min, tail)))
        return nt


class ReferenceRecognizer:
    """Decides membership (``accepts``) and viable prefixes (``is_prefix``) of a grammar's language."""

    def __init__(self, grammar: Grammar) -> None:
        self.grammar = grammar
        low = _Lowering(grammar)
        self._terminals = low.terminals
        self._start = low.start
        productive = self._productive(low)
        self._prods = [
            (lhs, rhs)
            for lhs, rhs in low.prods
            if lhs in productive
            and all(s in productive for s in rhs if s >= 0)
            and all(self._terminals[-s - 1].los for s in rhs if s < 0)
        ]
        self._by_lhs: dict[int, list[int]] = defaultdict(list)
        for k, (lhs, _) in enumerate(self._prods):
            self._by_lhs[lhs].append(k)
        self._nullable = self._nullable_set()
        self.empty_language = self._start not in productive
        self._unique = low.unique
        self._bounded = low.bounded

    def _productive(self, low: _Lowering) -> set[int]:
        done: set[int] = set()
        changed = True
        while changed:
            changed = False
            for lhs, rhs in low.prods:
                if lhs in done:
                    continue
                if all((s in done) if s >= 0 else bool(low.terminals[-s - 1].los) for s in rhs):
                    done.add(lhs)
                    changed = True
        return done

    def _nullable_set(self) -> set[int]:
        nullable: set[int] = set()
        changed = True
        while changed:
            changed = False
            for lhs, rhs in self._prods:
                if lhs not in nullable and all(s >= 0 and s in nullable for s in rhs):
                    nullable.add(lhs)
                    changed = True
        return nullable

    def _closure(
        self, seed: list[_Item], i: int, sets: list[dict[int, list[_Item]]], text: str = ""
    ) -> dict[int, list[_Item]]:
        """Predict/complete from ``seed``; returns the set indexed by each item's next symbol.
        ``text``: the input so far (a unique item's completion is checked against it)."""
        seen = set(seed)
        agenda = list(seed)
        waiting: dict[int, list[_Item]] = defaultdict(list)
        complete_key = 1 << 40  # bucket for completed items (no next symbol)
        while agenda:
            item = agenda.pop()
            p, d, o = item
            lhs, rhs = self._prods[p]
            new: list[_Item] = []
            if d < len(rhs):
                sym = rhs[d]
                waiting[sym].append(item)
                if sym >= 0:
                    new.extend((q, 0, i) for q in self._by_lhs.get(sym, ()))
                    if sym in self._nullable:
                        new.append((p, d + 1, o))
            else:
                waiting[complete_key].append(item)
                if o < i and not (
                    (lhs in self._unique and repeats_earlier_item(text, o, i))
                    or (lhs in self._bounded and len(json.loads(text[o:i])) > self._bounded[lhs])
                ):
                    new.extend((p2, d2 + 1, o2) for p2, d2, o2 in sets[o].get(lhs, ()))
            for nxt in new:
                if nxt not in seen:
                    seen.add(nxt)
                    agenda.append(nxt)
        return waiting

    def _run(self, text: str) -> tuple[int, dict[int, list[_Item]]]:
        """Parse as far as possible: (characters consumed, the last non-empty Earley set)."""
        if self.empty_language:
            return 0, {}
        sets = [self._closure([(k, 0, 0) for k in self._by_lhs[self._start]], 0, [])]
        for i, ch in enumerate(text):
            cp = ord(ch)
            scanned = [
                (p, d + 1, o)
                for sym, items in sets[i].items()
                if sym < 0 and cp in self._terminals[-sym - 1]
                for p, d, o in items
            ]
            if not scanned:
                return i, sets[i]
            sets.append(self._closure(scanned, i + 1, sets, text))
        return len(text), sets[-1]

    def accepts(self, text: str) -> bool:
        """Whether ``text`` is a word of the grammar's language."""
        consumed, last = self._run(text)
        if consumed < len(text):
            return False
        return any(self._prods[p][0] == self._start and o == 0 for p, _, o in last.get(1 << 40, ()))

    def is_prefix(self, text: str) -> bool:
        """Whether ``text`` can be extended (possibly by nothing) to a word of the language."""
        return not self.empty_language and self._run(text)[0] == len(text)

    def viable_prefix_length(self, text: str) -> int:
        """Length of the longest prefix of ``text`` that is a viable prefix (where matching stops)."""
        return self._run(text)[0]


# -- unique array items -------------------------------------------------------------------------


def repeats_earlier_item(text: str, start: int, end: int) -> bool:
    """Whether the JSON value ``text[start:end]``, an item of a JSON array, equals an earlier item
    of that array (found by reading the text back from ``start``: ``,`` and the item before it,
    until the ``[``)."""
    current = _value_key(text[start:end])
    i = start - 1
    while True:
        while i >= 0 and text[i] in " \t\n\r":
            i -= 1
        if i < 0 or text[i] != ",":
            return False
        i -= 1
        while i >= 0 and text[i] in " \t\n\r":
            i -= 1
        first = _value_start(text, i)
        if first < 0:
            return False
        if _value_key(text[first : i + 1]) == current:
            return True
        i = first - 1


def _value_key(text: str) -> Any:
    """A hashable key under JSON Schema's equality (numbers by exact value, objects by member set)."""
    return _key(json.loads(text, parse_float=Decimal))


def _key(v: Any) -> Any:
    if isinstance(v, bool) or v is None:
        return ("c", v)
    if isinstance(v, int | Decimal):
        return ("n", Fraction(v))
    if isinstance(v, str):
        return ("s", v)
    if isinstance(v, list):
        return ("a", tuple(_key(x) for x in v))
    return ("o", frozenset((k, _key(x)) for k, x in v.items()))


def _escaped(text: str, q: int) -> bool:
    n = 0
    while q - 1 - n >= 0 and text[q - 1 - n] == "\\":
        n += 1
    return n % 2 == 1


def _string_start(text: str, q: int) -> int:
    for k in range(q - 1, -1, -1):
        if text[k] == '"' and not _escaped(text, k):
            return k
    return -1


def _value_start(text: str, last: int) -> int:
    """The first index of the JSON value whose last character is ``text[last]`` (-1: none)."""
    if last < 0:
        return -1
    c = text[last]
    if c == '"':
        return _string_start(text, last)
    if c in "}]":
        depth = 0
        k = last
        while k >= 0:
            ch = text[k]
            if ch == '"':
                k = _string_start(text, k)
                if k < 0:
                    return -1
            elif ch in "}]":
                depth += 1
            elif ch in "{[":
                depth -= 1
                if depth == 0:
                    return k
            k -= 1
        return -1
    k = last
    while k > 0 and (text[k - 1].isalnum() or text[k - 1] in ".+-"):
        k -= 1
    return k
