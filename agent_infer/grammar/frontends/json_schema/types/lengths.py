"""``minLength``/``maxLength`` pushed into a ``pattern``'s expression, when that is exact.

A string under a pattern and a length bound is, in general, the product of the pattern's automaton
and a length counter: ``maxLength: 255`` makes ~256 copies of every pattern state, and the lowering
pays for each. Most patterns that come with a bound are simpler: ``^[a-z0-9-]+$`` is one class
repeated, ``^[\\w-][\\w/-]*[\\w-]$`` is fixed-width parts around one open repeat. For those the bound
moves onto that one repeat's counts (``[a-z0-9-]{1,255}``) and the language is unchanged.
:func:`bounded_pattern` does that rewrite on the decoded-level expression, or answers None when the
length is shared between several open parts (then only the product is exact) or a long fixed tail
follows the open part (then the product's state limit is the better judge of the cost).
That product is ``dfa_bound_length`` of the automata stage; :func:`bounded_rules` writes its rules
without building it.
"""

from __future__ import annotations

import math

from agent_infer.errors import GrammarLimitError
from agent_infer.grammar.automata import DFA
from agent_infer.grammar.frontends.json_schema.types.automaton_rules import encoded_head
from agent_infer.grammar.ir import Alt, CharClass, Empty, Expr, Literal, Ref, Repeat, Seq, alt, seq

_NO_MATCH: Expr = Alt(())
# Fixed-width text after the open repeat, at most: a counted repeat followed by w characters it may
# also match determinizes into up to 2^w states per count (``(a|b)*a(a|b){14}`` under maxLength
# 400 is millions), where the product automaton stops at its state limit in the front end.
_MAX_TAIL = 4


def _extent(expr: Expr) -> tuple[float, float]:
    """The fewest and most code points a match of ``expr`` has (``inf``: unbounded; an empty
    alternation, which matches nothing, gives ``(inf, 0)``)."""
    if isinstance(expr, Literal):
        return len(expr.text), len(expr.text)
    if isinstance(expr, CharClass):
        return 1, 1
    if isinstance(expr, Empty):
        return 0, 0
    if isinstance(expr, Seq):
        lo = hi = 0.0
        for item in expr.items:
            a, b = _extent(item)
            lo, hi = lo + a, hi + b
        return lo, hi
    if isinstance(expr, Alt):
        ext = [_extent(item) for item in expr.items]
        return min((a for a, _ in ext), default=math.inf), max((b for _, b in ext), default=0)
    if isinstance(expr, Repeat):
        a, b = _extent(expr.item)
        most = b * expr.max if expr.max is not None else (0 if b == 0 else math.inf)
        return a * expr.min, most
    return 0, math.inf


def _width(expr: Expr) -> int | None:
    """The number of code points every match of ``expr`` has, or None when matches differ in length."""
    fewest, most = _extent(expr)
    return int(fewest) if fewest == most else None


def bounded_pattern(expr: Expr, lo: int, hi: int | None) -> Expr | None:
    """The matches of ``expr`` whose length (in code points) lies in ``lo..hi`` as one expression
    of the same shape, or None when that needs the product automaton. ``Alt(())`` when none do."""
    if hi is not None and hi < lo:
        return _NO_MATCH
    fewest, most = _extent(expr)
    if lo <= fewest and (hi is None or most <= hi):
        return expr  # every match already has an allowed length (``^\S+$`` under minLength 1)
    w = _width(expr)
    if w is not None:
        return expr if lo <= w and (hi is None or w <= hi) else _NO_MATCH
    if isinstance(expr, Alt):
        parts = []
        for item in expr.items:
            part = bounded_pattern(item, lo, hi)
            if part is None:
                return None
            parts.append(part)
        return alt(*parts)
    if isinstance(expr, Repeat):
        step = _width(expr.item)
        if step is None or step == 0:
            return None
        # n items have n * step code points: n must lie in ceil(lo / step)..floor(hi / step).
        n_lo = max(expr.min, -(-lo // step))
        n_hi = hi // step if hi is not None else None
        if expr.max is not None:
            n_hi = expr.max if n_hi is None else min(n_hi, expr.max)
        if n_hi is not None and n_hi < n_lo:
            return _NO_MATCH
        return Repeat(expr.item, n_lo, n_hi)
    if isinstance(expr, Seq):
        # Fixed-width items take their share of the bound; the single open item takes the rest.
        fixed = tail = 0
        open_at = -1
        for i, item in enumerate(expr.items):
            iw = _width(item)
            if iw is None:
                if open_at >= 0:
                    return None
                open_at = i
            else:
                fixed += iw
                tail += iw if open_at >= 0 else 0
        if open_at < 0 or tail > _MAX_TAIL:
            return None
        if hi is not None and hi < fixed:
            return _NO_MATCH
        inner = bounded_pattern(expr.items[open_at], max(0, lo - fixed), None if hi is None else hi - fixed)
        if inner is None or inner == _NO_MATCH:
            return inner
        return seq(*expr.items[:open_at], inner, *expr.items[open_at + 1 :])
    return None


def bounded_rules(
    a: DFA, min_len: int, max_len: int, prefix: str, max_states: int = 4000
) -> tuple[Expr, list[tuple[str, Expr]]]:
    """``dfa_to_rules(dfa_bound_length(a, min_len, max_len), prefix)`` (the same rules, names and
    order) without building that product: its states are layers ``(pattern state, length)``, a
    state's edges are its pattern state's, retargeted one layer down, so the grouping and JSON
    encoding of the edges are done once per pattern state instead of once per pair, and liveness
    is a backward sweep over the layers."""
    a_edges, a_accept = a.edges, a.accept
    # Pairs are numbered breadth first, as dfa_bound_length meets them: every state of layer k
    # is numbered (met from layer k - 1) before any of layer k + 1.
    layers: list[list[int]] = [[0]]
    total = 1
    for _ in range(max_len):
        seen: dict[int, None] = {}
        for x in layers[-1]:
            for _lo, _hi, t in a_edges[x]:
                seen[t] = None
        total += len(seen)
        if total > max_states:
            raise GrammarLimitError(f"string constraint automaton exceeds {max_states} states")
        layers.append(list(seen))
    # Per pattern state: its targets with the JSON encoding of the ranges leading to each, in
    # first-edge order (dfa_to_rules's grouping), the same for every layer.
    groups: dict[int, list[tuple[int, tuple[Expr, ...]]]] = {}
    targets: dict[int, frozenset[int]] = {}
    heads: dict[tuple[tuple[int, int], ...], tuple[Expr, ...]] = {}
    for layer in layers:
        for x in layer:
            if x not in groups:
                by_target: dict[int, list[tuple[int, int]]] = {}
                for lo, hi, t in a_edges[x]:
                    by_target.setdefault(t, []).append((lo, hi))
                out = []
                for t, rs in by_target.items():
                    ranges = tuple(_merged(rs))
                    head = heads.get(ranges)
                    if head is None:
                        head = heads[ranges] = encoded_head(ranges)
                    out.append((t, head))
                groups[x] = out
                targets[x] = frozenset(by_target)
    # live[k]: the pattern states of layer k from which an accepted length is reachable.
    live: list[set[int]] = [set() for _ in layers]
    live[max_len] = {x for x in layers[max_len] if x in a_accept} if max_len >= min_len else set()
    for k in range(max_len - 1, -1, -1):
        below = live[k + 1]
        ends = k >= min_len
        live[k] = {x for x in layers[k] if (ends and x in a_accept) or not below.isdisjoint(targets[x])}
    if 0 not in live[0]:
        return Alt(()), []
    rules: list[tuple[str, Expr]] = []
    empty = Empty()
    start = Ref(f"{prefix}0")
    refs: dict[int, Ref] = {0: start}  # this layer's live states' references (their rule names)
    first = 0
    for k, layer in enumerate(layers):
        base = first + len(layer)
        # The next layer's references by pattern state (its numbers follow this layer's).
        next_refs = (
            {t: Ref(f"{prefix}{base + j}") for j, t in enumerate(layers[k + 1]) if t in live[k + 1]}
            if k < max_len
            else {}
        )
        ends = k >= min_len
        for x in layer:
            ref = refs.get(x)
            if ref is None:  # dead
                continue
            branches: list[Expr] = [
                Seq((*head, r)) if head else r for t, head in groups[x] if (r := next_refs.get(t)) is not None
            ]
            if ends and x in a_accept:
                branches.append(empty)
            rules.append((ref.name, branches[0] if len(branches) == 1 else Alt(tuple(branches))))
        refs = next_refs
        first = base
    return start, rules


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """A state's ranges to one target, adjacent ones joined, as the product's edge merge joins them."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if out and out[-1][1] + 1 == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out
