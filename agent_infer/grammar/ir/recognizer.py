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

Run-time checks (:class:`~agent_infer.grammar.ir.Check`) are decided as the matcher decides them:
a check's carriers are predicted as its productions and its other items as shadow items (a copy of
the parse that never makes a prefix viable), and a check's completion waits until the Earley set
is closed, then passes if the set of its items completed over the same span is accepted. Checks
that may end at one position are decided innermost first (by origin, then by their nesting at one
origin), so an inner check's verdict is known when an outer one reads it. A prefix is viable when
a carrier item can still read a character, which is exact for the checks the front ends build
(docs/grammar_engine.md, "Run-time checks").

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

from agent_infer.errors import GrammarDefinitionError
from agent_infer.grammar.ir.grammar import Grammar
from agent_infer.grammar.ir.nodes import (
    Alt,
    BoundedString,
    CharClass,
    Check,
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

_Item = tuple[int, int, int, int]  # (production index, dot, origin, 1 in a shadow parse else 0)
_COMPLETE = 1 << 40  # the bucket of completed items (no next symbol)


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
        # Check nonterminal -> (item nonterminals, carriers, accepted membership sets)
        self.checks: dict[int, tuple[tuple[int, ...], int, frozenset[int]]] = {}
        self.start = self.new_nt()
        self.prods.append((self.start, (self.rule_nt[grammar.root],)))
        for name, expr in grammar.rules:
            if isinstance(expr, Check):
                nt = self.rule_nt[name]
                items = tuple(self.rule_nt[r.name] for r in expr.items)
                self.checks[nt] = (items, expr.carriers, frozenset(expr.accept))
                self.prods.extend((nt, (item,)) for item in items[: expr.carriers])
                continue
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
        if isinstance(expr, Check):
            raise GrammarDefinitionError("a Check is only allowed as a rule's whole body")
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
        self._checks = low.checks
        self._check_rank = self._rank_checks() if low.checks else {}
        if any(nt in self._nullable for nt in self._checks):
            raise GrammarDefinitionError("a Check's carriers must not match the empty string")
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

    def _rank_checks(self) -> dict[int, int]:
        """Each check's nesting rank among the checks that may begin where it begins: a check whose
        item starts with another check (through leading nonterminals) ranks above it, so at one
        origin the inner one is decided first. A check that starts with itself has no rank."""
        first: dict[int, set[int]] = defaultdict(set)  # nonterminal -> nonterminals it may start with
        for lhs, rhs in self._prods:
            for sym in rhs:
                if sym < 0:
                    break
                first[lhs].add(sym)
                if sym not in self._nullable:
                    break
        for nt, (items, _, _) in self._checks.items():
            first[nt].update(items)
        rank: dict[int, int] = {}
        busy: set[int] = set()

        def of(nt: int) -> int:
            if nt in rank:
                return rank[nt]
            if nt in busy:
                raise GrammarDefinitionError("a Check begins with itself (left recursion through a Check)")
            busy.add(nt)
            seen, stack, inner = {nt}, list(first[nt]), 0
            while stack:
                x = stack.pop()
                if x in self._checks:
                    inner = max(inner, of(x) + 1)
                    continue
                for y in first[x]:
                    if y not in seen:
                        seen.add(y)
                        stack.append(y)
            busy.discard(nt)
            rank[nt] = inner
            return inner

        for nt in self._checks:
            of(nt)
        return rank

    def _closure(
        self, seed: list[_Item], i: int, sets: list[dict[int, list[_Item]]], text: str = ""
    ) -> dict[int, list[_Item]]:
        """Predict/complete from ``seed``; returns the set indexed by each item's next symbol.
        ``text``: the input so far (a unique item's completion is checked against it)."""
        seen = set(seed)
        agenda = list(seed)
        waiting: dict[int, list[_Item]] = defaultdict(list)
        # (check nonterminal, origin, shadow) -> its completed carrier items, decided once closed
        pending: dict[tuple[int, int, int], list[_Item]] = {}
        checks = self._checks
        while True:
            while agenda:
                item = agenda.pop()
                p, d, o, sh = item
                lhs, rhs = self._prods[p]
                new: list[_Item] = []
                if d < len(rhs):
                    sym = rhs[d]
                    waiting[sym].append(item)
                    if sym >= 0:
                        new.extend((q, 0, i, sh) for q in self._by_lhs.get(sym, ()))
                        if sym in checks:
                            items, carriers, _ = checks[sym]
                            new.extend(
                                (q, 0, i, 1) for s2 in items[carriers:] for q in self._by_lhs.get(s2, ())
                            )
                        if sym in self._nullable:
                            new.append((p, d + 1, o, sh))
                elif o < i and (
                    (lhs in self._unique and repeats_earlier_item(text, o, i))
                    or (lhs in self._bounded and len(json.loads(text[o:i])) > self._bounded[lhs])
                ):
                    continue  # a duplicate item or an overlong string does not complete
                elif lhs in checks:
                    pending.setdefault((lhs, o, sh), []).append(item)
                else:
                    waiting[_COMPLETE].append(item)
                    if o < i:
                        new.extend(
                            (p2, d2 + 1, o2, s2) for p2, d2, o2, s2 in sets[o].get(lhs, ()) if s2 == sh
                        )
                for nxt in new:
                    if nxt not in seen:
                        seen.add(nxt)
                        agenda.append(nxt)
            if not pending:
                return waiting
            # Innermost first: the latest origin, then the lowest rank at that origin.
            key = max(pending, key=lambda k: (k[1], -self._check_rank[k[0]]))
            completed = pending.pop(key)
            nt, o, sh = key
            items, _, accept = checks[nt]
            # Membership of each item over [o, i): completed there in either parse.
            done = {(self._prods[p][0], o2) for p, _, o2, _ in waiting[_COMPLETE]}
            bits = sum(1 << k for k, item_nt in enumerate(items) if (item_nt, o) in done)
            if bits not in accept:
                continue
            waiting[_COMPLETE].extend(completed)
            for p2, d2, o2, s2 in sets[o].get(nt, ()) if o < i else ():
                nxt = (p2, d2 + 1, o2, s2)
                if s2 == sh and nxt not in seen:
                    seen.add(nxt)
                    agenda.append(nxt)

    def _run(self, text: str) -> tuple[int, dict[int, list[_Item]]]:
        """Parse as far as possible: (characters consumed, the last non-empty Earley set)."""
        if self.empty_language:
            return 0, {}
        sets = [self._closure([(k, 0, 0, 0) for k in self._by_lhs[self._start]], 0, [])]
        for i, ch in enumerate(text):
            cp = ord(ch)
            scanned = [
                (p, d + 1, o, sh)
                for sym, items in sets[i].items()
                if sym < 0 and cp in self._terminals[-sym - 1]
                for p, d, o, sh in items
            ]
            if not scanned:
                return i, sets[i]
            closed = self._closure(scanned, i + 1, sets, text)
            if self._checks and not self._live(closed):
                return i, sets[i]
            sets.append(closed)
        return len(text), sets[-1]

    def _live(self, waiting: dict[int, list[_Item]]) -> bool:
        """Whether a set can lead anywhere: a carrier item reads a character next, or the root is
        complete (a set holding only shadow items or blocked checks is a dead end)."""
        if self._complete(waiting):
            return True
        return any(sym < 0 and any(sh == 0 for *_, sh in items) for sym, items in waiting.items())

    def _complete(self, last: dict[int, list[_Item]]) -> bool:
        return any(
            self._prods[p][0] == self._start and o == 0 and sh == 0 for p, _, o, sh in last.get(_COMPLETE, ())
        )

    def accepts(self, text: str) -> bool:
        """Whether ``text`` is a word of the grammar's language."""
        consumed, last = self._run(text)
        if consumed < len(text):
            return False
        return self._complete(last)

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
