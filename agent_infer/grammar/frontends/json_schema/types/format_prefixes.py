"""A ``format`` narrowed by a ``pattern`` that only fixes how the string starts (``^https?:``).

``format: uri`` with ``pattern: ^https:`` is the intersection of two regular languages; the
general route determinizes the format's expression (a URI automaton: the front end's slowest step
for such a schema) and multiplies it with the pattern's. When the pattern is a literal prefix
followed by anything, the intersection is that prefix followed by the format's Brzozowski
derivative by the prefix, which is computed on the expression itself, one character at a time,
and stays an expression: no automaton is built. A head with a few spellings (``https?``) is the
union of one such derivative per spelling. :func:`prefixed_format` answers None where that
does not apply or the derivative would grow past a small budget (the general route then runs).
"""

from __future__ import annotations

from agent_infer.grammar.frontends.json_schema.types.string_encoding import MAX_CP
from agent_infer.grammar.ir import Alt, CharClass, Empty, Expr, Literal, Repeat, Seq, alt, seq

_NONE: Expr = Alt(())
# IR nodes one derivative may build; formats are a few thousand nodes, prefixes a few characters.
_BUDGET = 20000


def _is_none(e: Expr) -> bool:
    return isinstance(e, Alt) and not e.items


class _OverBudget(Exception):
    """The derivative grew past the budget: the automaton route is taken instead."""


# Strings a pattern's head may spell, at most (``^https?://`` spells two).
_MAX_LEADS = 16


def literal_prefixes(search: Expr) -> list[str] | None:
    """The strings ``p1..pn`` when ``search`` (a pattern's search expression) is one of them
    followed by any string: ``^https?://`` gives ``["http://", "https://"]``; None when the head
    is not a small finite language or nothing follows it."""
    if not isinstance(search, Seq) or len(search.items) < 2:
        return None
    tail = search.items[-1]
    if not (isinstance(tail, Repeat) and tail.min == 0 and tail.max is None):
        return None
    item = tail.item
    if not isinstance(item, CharClass) or item.normalized() != ((0, MAX_CP),):
        return None
    leads = _spellings(Seq(search.items[:-1]))
    if leads is None or "" in leads:
        return None  # not a small finite head, or an optional one (the pattern accepts everything)
    return sorted(leads)


def _spellings(e: Expr) -> set[str] | None:
    """Every string ``e`` matches, if there are at most _MAX_LEADS of them."""
    if isinstance(e, Literal):
        return {e.text}
    if isinstance(e, Empty):
        return {""}
    if isinstance(e, CharClass):
        ranges = e.normalized()
        if sum(hi - lo + 1 for lo, hi in ranges) > _MAX_LEADS:
            return None
        return {chr(c) for lo, hi in ranges for c in range(lo, hi + 1)}
    if isinstance(e, Alt):
        out: set[str] = set()
        for x in e.items:
            words = _spellings(x)
            if words is None:
                return None
            out |= words
            if len(out) > _MAX_LEADS:
                return None
        return out
    if isinstance(e, Seq):
        out = {""}
        for x in e.items:
            words = _spellings(x)
            if words is None or len(out) * len(words) > _MAX_LEADS:
                return None
            out = {a + b for a in out for b in words}
        return out
    if isinstance(e, Repeat) and e.max is not None and e.max <= _MAX_LEADS:
        words = _spellings(e.item)
        if words is None:
            return None
        out = {""} if e.min == 0 else set()
        run = {""}
        for k in range(1, e.max + 1):
            if len(run) * len(words) > _MAX_LEADS:
                return None
            run = {a + b for a in run for b in words}
            if k >= e.min:
                out |= run
            if len(out) > _MAX_LEADS:
                return None
        return out
    return None


class _Deriver:
    def __init__(self) -> None:
        self._nullable: dict[int, bool] = {}
        self._keep: list[Expr] = []  # keeps memo keys (ids) alive
        self.built = 0

    def nullable(self, e: Expr) -> bool:
        key = id(e)
        hit = self._nullable.get(key)
        if hit is not None:
            return hit
        if isinstance(e, Empty):
            out = True
        elif isinstance(e, Literal):
            out = not e.text
        elif isinstance(e, CharClass):
            out = False
        elif isinstance(e, Seq):
            out = all(self.nullable(x) for x in e.items)
        elif isinstance(e, Alt):
            out = any(self.nullable(x) for x in e.items)
        elif isinstance(e, Repeat):
            out = e.min == 0 or self.nullable(e.item)
        else:
            raise _OverBudget  # a Ref or foreign node: no derivative here
        self._keep.append(e)
        self._nullable[key] = out
        return out

    def _count(self, e: Expr) -> Expr:
        self.built += 1
        if self.built > _BUDGET:
            raise _OverBudget
        return e

    def derive(self, e: Expr, cp: int) -> Expr:
        """The strings ``w`` such that ``chr(cp) + w`` matches ``e``."""
        if isinstance(e, Empty):
            return _NONE
        if isinstance(e, Literal):
            if not e.text or ord(e.text[0]) != cp:
                return _NONE
            return Literal(e.text[1:]) if len(e.text) > 1 else Empty()
        if isinstance(e, CharClass):
            return Empty() if any(lo <= cp <= hi for lo, hi in e.normalized()) else _NONE
        if isinstance(e, Seq):
            parts: list[Expr] = []
            for i, item in enumerate(e.items):
                d = self.derive(item, cp)
                if not _is_none(d):
                    parts.append(self._count(seq(d, *e.items[i + 1 :])))
                if not self.nullable(item):
                    break
            return alt(*parts) if parts else _NONE
        if isinstance(e, Alt):
            parts = [d for d in (self.derive(x, cp) for x in e.items) if not _is_none(d)]
            return self._count(alt(*parts)) if parts else _NONE
        if isinstance(e, Repeat):
            if e.max == 0:
                return _NONE
            d = self.derive(e.item, cp)
            if _is_none(d):
                return _NONE
            # x{m,M} is x{0,M} when x matches the empty string.
            lo = 0 if self.nullable(e.item) else max(e.min - 1, 0)
            hi = None if e.max is None else e.max - 1
            rest = Empty() if hi == 0 else Repeat(e.item, lo, hi)
            return self._count(seq(d, rest))
        raise _OverBudget


def prefixed_format(fmt: Expr, prefix: str) -> Expr | None:
    """The strings of ``fmt`` that start with ``prefix``, as ``prefix`` followed by the derivative,
    or None when the derivative is over budget or meets a rule reference."""
    deriver = _Deriver()
    rest = fmt
    try:
        for ch in prefix:
            rest = deriver.derive(rest, ord(ch))
            if _is_none(rest):
                return _NONE
    except _OverBudget:
        return None
    return seq(Literal(prefix), rest)
