"""Rules for "any key but these names": JSON-encoded, right-linear, read off the names' trie.

``names_complement_rules`` and its pieces write the complement straight off the names' trie
(``names_dfa`` of the automata stage) as rules, the shape that
``dfa_to_rules(dfa_complement(names_dfa(names)))`` would produce.
"""

from __future__ import annotations

from collections.abc import Callable

from agent_infer.grammar.automata import DFA, names_dfa
from agent_infer.grammar.frontends.json_schema.types.automaton_rules import encoded_head
from agent_infer.grammar.frontends.json_schema.types.string_encoding import MAX_CP
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
