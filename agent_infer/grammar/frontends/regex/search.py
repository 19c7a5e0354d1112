"""Unanchored regex search: the strings that *contain* a match of a pattern, as JSON Schema's
``pattern`` keyword means, honouring ``^``/``$`` (:func:`regex_search_expr`).

The parsed pattern is padded with ``.*`` on each side that is not anchored (each alternative
separately), absorbing optional edges into the padding so that determinizing the search stays
small, and refused when it would have to track too many positions at once.
"""

from __future__ import annotations

import functools

from agent_infer.errors import GrammarLimitError
from agent_infer.grammar.common.memo import register_cache
from agent_infer.grammar.frontends.regex.assertions import assertion_expr, has_assertions
from agent_infer.grammar.frontends.regex.escapes import _Anchor
from agent_infer.grammar.frontends.regex.parser import (
    ANY_STRING,
    MAX_SEARCH_SPAN,
    RegexParser,
    position_span,
)
from agent_infer.grammar.ir import (
    Alt,
    Empty,
    Expr,
    Literal,
    Repeat,
    Seq,
    alt,
    seq,
)

_ANY = ANY_STRING


def _has_anchor(expr: Expr) -> bool:
    if isinstance(expr, _Anchor):
        return True
    return any(_has_anchor(e) for e in expr.children())


def _nullable(expr: Expr) -> bool:
    """Matches the empty string (``expr`` has no anchors)."""
    if isinstance(expr, Empty):
        return True
    if isinstance(expr, Seq):
        return all(_nullable(e) for e in expr.items)
    if isinstance(expr, Alt):
        return any(_nullable(e) for e in expr.items)
    if isinstance(expr, Repeat):
        return expr.min == 0 or _nullable(expr.item)
    return isinstance(expr, Literal) and not expr.text


def _absorb(expr: Expr, end: bool) -> Expr:
    """An anchor-free ``expr`` shortened where ``.*`` follows it (``end``) or precedes it, with the
    same padded language: ``X Y? .*`` is ``X .*``, as every string ``X Y`` starts is already in
    ``X .*``. A search for a URL pattern whose tail is optional is then a search for its head,
    instead of a subset construction over the tail's hundreds of states."""
    if _nullable(expr):
        return Empty()
    if isinstance(expr, Seq):
        items = list(expr.items)
        while _nullable(items[-1] if end else items[0]):  # not all: expr is not nullable
            items.pop(-1 if end else 0)
        if end:
            return seq(*items[:-1], _absorb(items[-1], end))
        return seq(_absorb(items[0], end), *items[1:])
    if isinstance(expr, Alt):
        return alt(*(_absorb(e, end) for e in expr.items))
    if isinstance(expr, Repeat):  # min >= 1, as expr is not nullable
        edge = _absorb(expr.item, end)
        if expr.min == 1:
            return edge
        rest = Repeat(expr.item, expr.min - 1, expr.min - 1)
        return seq(rest, edge) if end else seq(edge, rest)
    return expr


def _pad(expr: Expr, pre: bool, suf: bool) -> Expr:
    """``expr`` (anchor-free) with ``.*`` on the chosen sides."""
    if suf:
        expr = _absorb(expr, True)
    if pre:
        expr = _absorb(expr, False)
    if isinstance(expr, Empty):
        return _ANY if pre or suf else expr
    return seq(_ANY if pre else Empty(), expr, _ANY if suf else Empty())


def _search(expr: Expr, pre: bool, suf: bool) -> Expr:
    """``expr`` padded with ``.*`` on the sides that are not anchored (``pre``/``suf`` = may pad)."""
    if isinstance(expr, _Anchor):
        return _ANY if (suf if expr.start else pre) else Empty()
    if not _has_anchor(expr):
        return _pad(expr, pre, suf)
    if isinstance(expr, Alt):
        parts = [_search(e, pre, suf) for e in expr.items]
        # One branch that takes every string makes the others redundant.
        return _ANY if any(p == _ANY for p in parts) else alt(*parts)
    if isinstance(expr, Seq) and len(expr.items) > 1:
        items = list(expr.items)
        if isinstance(items[0], _Anchor) and items[0].start:
            return _search(seq(*items[1:]), False, suf)
        if isinstance(items[-1], _Anchor) and not items[-1].start:
            return _search(seq(*items[:-1]), pre, False)
        if suf and not _has_anchor(items[-1]):
            # The anchor-free tail of the sequence: absorb it into the trailing .*.
            k = len(items) - 1
            while k > 0 and not _has_anchor(items[k - 1]):
                k -= 1
            tail_items = _absorb(seq(*items[k:]), True)
            return seq(_search(seq(*items[:k]), pre, False), tail_items, _ANY)
        if pre and not _has_anchor(items[0]):
            k = 1
            while k < len(items) and not _has_anchor(items[k]):
                k += 1
            head_items = _absorb(seq(*items[:k]), False)
            return seq(_ANY, head_items, _search(seq(*items[k:]), False, suf))
        head = _search(items[0], pre, False)
        tail = _search(items[-1], False, suf)
        return seq(head, *items[1:-1], tail)
    return seq(_ANY if pre else Empty(), expr, _ANY if suf else Empty())


@functools.lru_cache(maxsize=1024)
def regex_search_expr(pattern: str, dialect: str = "ecma") -> Expr:
    """Strings *containing* a match of ``pattern`` (JSON Schema semantics), honouring ``^``/``$``.

    ``^`` pins only the start and ``$`` only the end; each alternative is padded separately.
    GrammarLimitError (with the position of the first repeat that crosses it) when the padded
    search would have to track more than :data:`MAX_SEARCH_SPAN` positions at once.
    Cached (a pure function; IR nodes are immutable): schemas repeat their patterns. Errors are
    raised again on every call.
    """
    parser = RegexParser(pattern, dialect)
    raw = parser.parse()
    if has_assertions(raw):
        return assertion_expr(raw, search=True)
    found = _search(raw, True, True)
    if _searchposition_span(found, parser.spans)[1] > MAX_SEARCH_SPAN:
        raise GrammarLimitError(
            f"pattern {_excerpt(pattern)} is too long to search for: more than {MAX_SEARCH_SPAN}"
            f" character positions once its repeats are unrolled"
            f" (position {parser.long_repeat or 0})"
        )
    return found


def _searchposition_span(expr: Expr, memo: dict[int, int]) -> tuple[int | None, int]:
    """(positions from the last ``.*`` inside ``expr`` to its end, None without one; the longest
    such run that starts inside ``expr``): what determinizing the search keeps in one state set."""
    if expr is _ANY:
        return 0, 0
    if isinstance(expr, Seq):
        running: int | None = None
        best = 0
        for item in expr.items:
            tail, inner = _searchposition_span(item, memo)
            best = max(best, inner)
            if running is not None:
                running += position_span(item, memo)
            if tail is not None:
                running = tail if running is None else max(running, tail)
            best = max(best, running or 0)
        return running, best
    if isinstance(expr, Alt):
        found = [_searchposition_span(e, memo) for e in expr.items]
        tails = [t for t, _ in found if t is not None]
        return (max(tails) if tails else None), max((b for _, b in found), default=0)
    if isinstance(expr, Repeat):
        tail, inner = _searchposition_span(expr.item, memo)
        if tail is None:
            return None, inner
        copies = expr.min + 1 if expr.max is None else expr.max
        tail += position_span(expr.item, memo) * max(copies - 1, 0)
        return tail, max(inner, tail)
    return None, 0


def _excerpt(pattern: str) -> str:
    return repr(pattern) if len(pattern) <= 60 else repr(pattern[:57]) + "..."


register_cache(regex_search_expr)
