"""Operations on code-point DFAs that build new ones: the product (intersection), its special case
with a length counter, and the complement."""

from __future__ import annotations

from agent_infer.errors import GrammarLimitError
from agent_infer.grammar.automata.dfa import DEFAULT_MAX_STATES, DFA, MAX_CP, Edge


def new_product_state(
    pair: tuple[int, int], index: dict[tuple[int, int], int], order: list[tuple[int, int]], max_states: int
) -> int:
    """Number a product state first met as ``pair`` (within ``max_states``, else GrammarLimitError)."""
    if len(order) >= max_states:
        raise GrammarLimitError(f"string constraint automaton exceeds {max_states} states")
    index[pair] = len(order)
    order.append(pair)
    return index[pair]


def _merge(edges: list[Edge]) -> list[Edge]:
    edges.sort()
    out: list[Edge] = []
    for lo, hi, t in edges:
        if out and out[-1][2] == t and out[-1][1] + 1 == lo:
            out[-1] = (out[-1][0], hi, t)
        else:
            out.append((lo, hi, t))
    return out


def dfa_intersect(a: DFA, b: DFA, max_states: int = DEFAULT_MAX_STATES) -> DFA:
    """Product automaton accepting strings of both."""
    index = {(0, 0): 0}
    order = [(0, 0)]
    edges: list[list[Edge]] = []
    accept: set[int] = set()
    i = 0
    while i < len(order):
        x, y = order[i]
        if x in a.accept and y in b.accept:
            accept.add(i)
        out: list[Edge] = []
        # Every DFA here keeps its edges sorted and disjoint, so the b-edges meeting an a-edge are
        # one run, found by a pointer that only moves forward. Pairs come in the same order as a
        # nested loop over both lists (a-major), so new states get the same numbers.
        eb = b.edges[y]
        nb = len(eb)
        j0 = 0
        for lo1, hi1, t1 in a.edges[x]:
            while j0 < nb and eb[j0][1] < lo1:
                j0 += 1
            j = j0
            while j < nb and eb[j][0] <= hi1:
                lo2, hi2, t2 = eb[j]
                j += 1
                pair = (t1, t2)
                target = index.get(pair)
                if target is None:
                    target = new_product_state(pair, index, order, max_states)
                out.append((lo1 if lo1 > lo2 else lo2, hi1 if hi1 < hi2 else hi2, target))
        edges.append(_merge(out))
        i += 1
    return DFA(edges, accept)


def dfa_complement(a: DFA) -> DFA:
    """Strings (over all code points) that ``a`` rejects."""
    sink = len(a.edges)
    edges: list[list[Edge]] = []
    for out in [*a.edges, []]:
        full: list[Edge] = []
        nxt = 0
        for lo, hi, t in sorted(out):
            if lo > nxt:
                full.append((nxt, lo - 1, sink))
            full.append((lo, hi, t))
            nxt = hi + 1
        if nxt <= MAX_CP:
            full.append((nxt, MAX_CP, sink))
        edges.append(full)
    return DFA(edges, set(range(len(edges))) - a.accept)


def dfa_bound_length(a: DFA, min_len: int, max_len: int | None, max_states: int = DEFAULT_MAX_STATES) -> DFA:
    """``dfa_intersect(a, dfa_length(min_len, max_len))`` without the general product: the length
    automaton has one full-range edge per state, so a pair's edges are ``a``'s (sorted and
    disjoint), retargeted. States and edges come out as ``dfa_intersect`` makes them."""
    n = max(min_len, 0) if max_len is None else max_len
    index = {(0, 0): 0}
    order = [(0, 0)]
    edges: list[list[Edge]] = []
    accept: set[int] = set()
    a_edges, a_accept = a.edges, a.accept
    i = 0
    while i < len(order):
        x, k = order[i]
        if k >= min_len and x in a_accept:
            accept.add(i)
        out: list[Edge] = []
        if max_len is None or k < n:
            k1 = k + 1 if k < n else n
            for lo, hi, t in a_edges[x]:
                pair = (t, k1)
                target = index.get(pair)
                if target is None:
                    target = new_product_state(pair, index, order, max_states)
                if out and out[-1][2] == target and out[-1][1] + 1 == lo:
                    out[-1] = (out[-1][0], hi, target)  # as _merge would (complements leave these)
                else:
                    out.append((lo, hi, target))
        edges.append(out)
        i += 1
    return DFA(edges, accept)
