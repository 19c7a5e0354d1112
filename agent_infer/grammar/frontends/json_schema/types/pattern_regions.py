"""Key regions of an object's ``patternProperties``: which sets of patterns a key can match at once.

A key matching patterns S gets the value schema "all of S's schemas" (none matched:
``additionalProperties``), so each non-empty region is one kind of additional member. With n
patterns there are up to 2^n regions; only sets whose patterns pairwise overlap can be non-empty,
so the sets are enumerated as cliques of the overlap graph (most real patterns are disjoint:
``^name:(en|nl)$``, ``^contacts:[0-3]:surName$``, ...), and a set's key automaton leaves out the
complements of patterns disjoint from one of its own.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from agent_infer.grammar.automata import DFA, dfa_intersect, dfa_is_empty

# Patterns enumerated in full (2^n regions, no overlap test), and the limits past which an
# object's patternProperties are refused: patterns, and regions that may be non-empty.
SMALL = 3
MAX_PATTERNS = 32
MAX_REGIONS = 64

Mask = tuple[bool, ...]


def region_masks(n: int, dfa: Callable[[int], DFA]) -> tuple[list[Mask], set[tuple[int, int]]] | None:
    """The masks (which patterns match) of the regions to build, and the pairs (i, j), i < j, of
    patterns no key matches both; None past MAX_PATTERNS or MAX_REGIONS."""
    if n <= SMALL:
        return list(itertools.product((False, True), repeat=n)), set()
    if n > MAX_PATTERNS:
        return None
    apart = {(i, j) for i in range(n) for j in range(i + 1, n) if dfa_is_empty(dfa_intersect(dfa(i), dfa(j)))}
    out: list[Mask] = []

    def grow(chosen: list[int], start: int) -> bool:
        out.append(tuple(i in chosen for i in range(n)))
        if len(out) > MAX_REGIONS:
            return False
        for k in range(start, n):
            if all((i, k) not in apart for i in chosen) and not grow([*chosen, k], k + 1):
                return False
        return True

    return (out, apart) if grow([], 0) else None


def needed(mask: Mask, q: int, apart: set[tuple[int, int]]) -> bool:
    """Whether region ``mask``'s automaton must exclude pattern q (not one of its own): not when
    one of its own patterns is disjoint from q already."""
    return not any(m and ((i, q) in apart or (q, i) in apart) for i, m in enumerate(mask))
