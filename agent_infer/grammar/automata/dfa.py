"""The code-point DFA: states numbered from 0 (the start), each with sorted, disjoint
``(lo, hi, target)`` edges over Unicode code points, and the limits every construction obeys."""

from __future__ import annotations

from dataclasses import dataclass, field

from agent_infer.grammar.ir import MAX_CODEPOINT

# The alphabet: every Unicode code point (complements and "any character" edges end here).
MAX_CP = MAX_CODEPOINT

Edge = tuple[int, int, int]  # lo, hi, target

# Every construction raises GrammarLimitError past this many states (names_dfa's trie nodes too).
DEFAULT_MAX_STATES = 4000
TRIE_MAX_STATES = DEFAULT_MAX_STATES


@dataclass
class DFA:
    """Deterministic automaton: ``edges[s]`` are disjoint (lo, hi, target) ranges; start is 0."""

    edges: list[list[Edge]]
    accept: set[int]
    # live_states' answer, kept: emptiness tests and rule emission both need it (DFAs are not mutated).
    live: set[int] | None = field(default=None, compare=False, repr=False)
