"""Automata over property names: "exactly these names" and "any key but these names".

``names_dfa`` is the trie of the names as a DFA (what determinizing an alternation of literals
gives, without the subset construction); ``names_complement_rules`` and its pieces write the
complement straight off that trie as JSON-encoded right-linear rules, the shape that
``dfa_to_rules(dfa_complement(names_dfa(names)))`` would produce.
"""

from __future__ import annotations

from collections.abc import Callable

from agent_infer.errors import GrammarLimitError
from agent_infer.grammar.automata.dfa import _DEFAULT_MAX_STATES, DFA, Edge, encoded_head
from agent_infer.grammar.frontends.json_schema.text import MAX_CP
from agent_infer.grammar.ir import Alt, Empty, Expr, Ref, Seq

Head = Callable[[tuple[tuple[int, int], ...]], tuple[Expr, ...]]


def names_complement_rules(
    names: list[str], prefix: str, trie: DFA | None = None, head: Head | None = None
) -> tuple[Expr, list[tuple[str, Expr]]]:
    """``dfa_to_rules(dfa_complement(names_dfa(names)), prefix)`` read off the trie directly.

    In that complement every trie state is live (its gaps lead to the accepting sink, numbered
    after the trie), a state's targets come in code point order with the sink where its first gap
    is, and only the names themselves are rejected. ``trie``: ``names_dfa(names)`` if at hand.
    ``head``: how an edge class is encoded (default: :func:`encode_class`'s items, inline).
    """
    if trie is None:
        trie = names_dfa(names)
    sink = len(trie.edges)
    sink_ref = Ref(f"{prefix}{sink}")
    rules: list[tuple[str, Expr]] = []
    for s, out in enumerate(trie.edges):
        children = [(cp, Ref(f"{prefix}{child}")) for cp, _, child in out]
        rules.append((f"{prefix}{s}", complement_node(children, s in trie.accept, sink_ref, head)))
    rules.append((f"{prefix}{sink}", complement_sink(sink_ref, head)))
    return Ref(f"{prefix}0"), rules


def code_point_gaps(cps: list[int] | tuple[int, ...]) -> tuple[list[tuple[int, int]], int]:
    """The code point ranges between sorted ``cps`` (and after the last, up to ``MAX_CP``), and the
    index of the first child that comes after a gap (where the gap branch goes in code point order)."""
    gaps: list[tuple[int, int]] = []
    sink_at = -1
    nxt = 0
    for k, cp in enumerate(cps):
        if cp > nxt:
            if sink_at < 0:
                sink_at = k
            gaps.append((nxt, cp - 1))
        nxt = cp + 1
    if nxt <= MAX_CP:
        if sink_at < 0:
            sink_at = len(cps)
        gaps.append((nxt, MAX_CP))
    return gaps, sink_at


def complement_node(
    children: list[tuple[int, Ref]], accepting: bool, sink_ref: Ref, head: Head | None = None
) -> Expr:
    """The rule of one trie node in "any key but these names": each child's code point leads to
    the child's rule, the gaps between them to the accepting sink (kept in code point order), and
    the key may end here unless the node spells a name (``accepting`` in the trie)."""
    gaps, sink_at = code_point_gaps([cp for cp, _ in children])
    enc = head or encoded_head
    branches: list[Expr] = []
    for k, (cp, ref) in enumerate(children):
        if k == sink_at:
            branches.append(_branch(tuple(gaps), sink_ref, enc))
        branches.append(_branch(((cp, cp),), ref, enc))
    if sink_at == len(children):
        branches.append(_branch(tuple(gaps), sink_ref, enc))
    if not accepting:
        branches.append(_EMPTY)
    return branches[0] if len(branches) == 1 else Alt(tuple(branches))


def complement_sink(sink_ref: Ref, head: Head | None = None) -> Expr:
    """The accepting sink of "any key but these names" (``sink_ref`` names it): any rest of a key."""
    return Alt((_branch(((0, MAX_CP),), sink_ref, head or encoded_head), _EMPTY))


_EMPTY = Empty()


def _branch(ranges: tuple[tuple[int, int], ...], ref: Ref, head: Head) -> Expr:
    """``seq(<ranges encoded by head>, ref)``."""
    items = head(ranges)
    return Seq((*items, ref)) if items else ref


def names_dfa(names: list[str]) -> DFA:
    """Exactly the given strings.

    The trie of the names, numbered breadth first with children in code point order: the DFA
    that determinizing ``alt(*map(lit, names))`` gives (each prefix is one subset of NFA states,
    met first from its parent), with its state limits and errors, without the subset construction.
    """
    distinct = list(dict.fromkeys(names))
    # NFA states that construction would allocate: the start, then for an alternation its end
    # and per branch a start plus one state per character; a single name only its characters.
    nfa_states = 1 + (
        sum(len(n) for n in distinct) if len(distinct) == 1 else 1 + sum(1 + len(n) for n in distinct)
    )
    nfa_limit = _DEFAULT_MAX_STATES * 4
    if nfa_states > nfa_limit:
        raise GrammarLimitError(f"string constraint automaton exceeds {nfa_limit} states")
    # Each trie node: the names that pass through it, and its depth (the prefix length).
    order: list[list[str]] = [distinct]
    depth = [0]
    edges: list[list[Edge]] = []
    accept: set[int] = set()
    i = 0
    while i < len(order):
        group, d = order[i], depth[i]
        children: dict[str, list[str]] = {}
        for name in group:
            if len(name) == d:
                accept.add(i)
            else:
                children.setdefault(name[d], []).append(name)
        out: list[Edge] = []
        for ch in sorted(children):
            if len(order) >= _DEFAULT_MAX_STATES:
                raise GrammarLimitError(f"string constraint automaton exceeds {_DEFAULT_MAX_STATES} states")
            cp = ord(ch)
            out.append((cp, cp, len(order)))
            order.append(children[ch])
            depth.append(d + 1)
        edges.append(out)
        i += 1
    return DFA(edges, accept)
