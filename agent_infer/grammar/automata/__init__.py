"""Code-point automata: the DFA algebra for string constraints that a CFG cannot combine directly.

``pattern`` + ``minLength``, two patterns in ``allOf``, property keys "matching P but not a declared
name": each needs the intersection or complement of regular languages, which the IR (a CFG) has no
operator for. DFAs are built from decoded-string IR expressions (:mod:`.construction`), combined
(:mod:`.operations`) and queried (:mod:`.queries`); a front end writes the result back as grammar
rules in its own text encoding. Every step is bounded by ``max_states``. This stage imports only the
IR: it knows nothing of JSON.
"""

from agent_infer.grammar.automata.construction import dfa_length, expr_to_dfa, names_dfa
from agent_infer.grammar.automata.dfa import DEFAULT_MAX_STATES, DFA, MAX_CP, TRIE_MAX_STATES, Edge
from agent_infer.grammar.automata.operations import (
    dfa_bound_length,
    dfa_complement,
    dfa_intersect,
    new_product_state,
)
from agent_infer.grammar.automata.queries import (
    dfa_accepts,
    dfa_includes,
    dfa_is_empty,
    dfa_universal,
    live_states,
)

__all__ = [
    "DEFAULT_MAX_STATES",
    "DFA",
    "MAX_CP",
    "TRIE_MAX_STATES",
    "Edge",
    "dfa_accepts",
    "dfa_bound_length",
    "dfa_complement",
    "dfa_includes",
    "dfa_intersect",
    "dfa_is_empty",
    "dfa_length",
    "dfa_universal",
    "expr_to_dfa",
    "live_states",
    "names_dfa",
    "new_product_state",
]
