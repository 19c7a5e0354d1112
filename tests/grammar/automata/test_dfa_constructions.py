"""Code-point automata: fast constructions against general ones.

``names_dfa`` builds a trie instead of determinizing ``alt(*names)``, ``names_complement_rules``
reads "any key but these" off it, ``dfa_intersect`` walks sorted edges with a pointer, the merged
subset construction folds equivalent subsets, and ``dfa_includes`` decides inclusion without the
complement product. Each must give exactly what the general construction gives: same states, same
numbering, same rules, same errors.
"""

from __future__ import annotations

import random

import pytest

from agent_infer.errors import GrammarLimitError
from agent_infer.grammar.automata import (
    DFA,
    Edge,
    dfa_accepts,
    dfa_complement,
    dfa_includes,
    dfa_intersect,
    dfa_is_empty,
    dfa_length,
    expr_to_dfa,
    names_dfa,
)
from agent_infer.grammar.frontends.json_schema.keys.names import names_complement_rules
from agent_infer.grammar.frontends.json_schema.types.automaton_rules import dfa_to_rules
from agent_infer.grammar.frontends.regex.search import regex_search_expr
from agent_infer.grammar.ir import Alt, alt, lit

NAME_SETS = [
    [],
    [""],
    ["", ""],
    ["a", "a"],
    ["", "a", "ab", "b"],
    ["apiVersion", "kind", "metadata", "spec", "status"],
    ["\x00a", "\x00", "b"],
    ["é", "e\u0301", "\U0001f600x", "\ud800"],
    [f"key{i}" for i in range(300)],
]


def _subset_construction(names: list[str]) -> DFA:
    """The general construction names_dfa must equal: determinize the alternation of the names as
    literals (one state per subset, as the trie has one per prefix)."""
    return expr_to_dfa(alt(*(lit(n) for n in names)) if names else Alt(()), merge_equivalent=False)


def _outcome(make: object) -> object:
    try:
        d = make()  # type: ignore[operator]
    except GrammarLimitError as exc:
        return ("error", str(exc))
    return (d.edges, sorted(d.accept)) if isinstance(d, DFA) else d


@pytest.mark.parametrize("names", [*NAME_SETS, ["x" * 4001, "y"], ["a" * 10 + str(i) for i in range(1500)]])
def test_names_trie_is_the_determinized_alternation(names: list[str]) -> None:
    """Same states in the same order, and the same limit errors (DFA states, then NFA states)."""
    assert _outcome(lambda: names_dfa(names)) == _outcome(lambda: _subset_construction(names))


@pytest.mark.parametrize("names", [n for n in NAME_SETS if n])
def test_complement_rules_read_off_the_trie(names: list[str]) -> None:
    general = dfa_to_rules(dfa_complement(_subset_construction(names)), "k-")
    assert names_complement_rules(names, "k-") == general


def _nested_intersect(a: DFA, b: DFA, max_states: int = 4000) -> DFA:
    """The product construction with a plain nested loop over both edge lists."""
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
        for lo1, hi1, t1 in a.edges[x]:
            for lo2, hi2, t2 in b.edges[y]:
                lo, hi = max(lo1, lo2), min(hi1, hi2)
                if lo > hi:
                    continue
                if (t1, t2) not in index:
                    if len(order) >= max_states:
                        raise GrammarLimitError(f"string constraint automaton exceeds {max_states} states")
                    index[(t1, t2)] = len(order)
                    order.append((t1, t2))
                out.append((lo, hi, index[(t1, t2)]))
        out.sort()
        merged: list[Edge] = []
        for lo, hi, t in out:
            if merged and merged[-1][2] == t and merged[-1][1] + 1 == lo:
                merged[-1] = (merged[-1][0], hi, t)
            else:
                merged.append((lo, hi, t))
        edges.append(merged)
        i += 1
    return DFA(edges, accept)


PATTERNS = [
    "^[a-z]{2,5}(\\d+|é)$",
    "^(\\([0-9]{3}\\))?[0-9]{3}-[0-9]{4}$",
    "[^\\s]+@[^\\s]+",
    "^\\w+(\\.\\w+)*$",
    "^(?:[A-Z]|[a-z]{3}|[0-9])+x?$",
    "^[\\u4e00-\\u9fff]+$",
]


def test_pointer_intersection_matches_the_nested_loop() -> None:
    dfas = [expr_to_dfa(regex_search_expr(p, dialect="ecma")) for p in PATTERNS]
    dfas += [names_dfa(n) for n in NAME_SETS]
    rng = random.Random(7)
    for _ in range(150):
        a, b = rng.choice(dfas), rng.choice(dfas)
        if rng.random() < 0.5:
            a = dfa_complement(a)
        if rng.random() < 0.3:
            b = dfa_length(rng.randint(0, 4), rng.choice([None, 2, 9]))
        assert _outcome(lambda a=a, b=b: dfa_intersect(a, b)) == _outcome(
            lambda a=a, b=b: _nested_intersect(a, b)
        )
    small = dfa_length(0, None)
    assert _outcome(lambda: dfa_intersect(dfas[0], small, 3)) == _outcome(
        lambda: _nested_intersect(dfas[0], small, 3)
    )


@pytest.mark.parametrize("pattern", ["^dev|alpha|beta|rc|RC|stable$", "ab|ba|a[bc]d", "^x(y|z)*$", "q.r|rq"])
def test_merged_construction_is_smaller_and_the_same_language(pattern: str) -> None:
    """Subsets that hold an accept-everything loop are one state, and subsets equal on their moving
    members and acceptance are one state: same strings as the plain construction (and as
    ``re.search``), often far fewer states (the first pattern: 644 plain)."""
    import re

    expr = regex_search_expr(pattern, dialect="ecma")
    merged = expr_to_dfa(expr)
    plain = expr_to_dfa(expr, merge_equivalent=False)
    assert len(merged.edges) <= len(plain.edges)
    rng = random.Random(pattern)
    alphabet = "abcdelpqrstvxyzRC-"
    words = ["", "dev", "stable", "xstable", "alphabet", "RCx", "qzr", "rq", "abd", "acd", "xyzy"]
    words += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12))) for _ in range(400)]
    for w in words:
        want = re.search(pattern, w) is not None
        assert dfa_accepts(merged, w) is want, w
        assert dfa_accepts(plain, w) is want, w
    if pattern.startswith("^dev"):
        assert len(merged.edges) < 40 < len(plain.edges)


_INCLUSION_PATTERNS = [
    "^.*@.*$",
    "^[a-z]+@[a-z]+$",
    "@",
    "^[a-z]",
    "^[a-z0-9]{1,4}$",
    "x*",
    "^ab|cd$",
    "^a.*b$",
]


@pytest.mark.parametrize("wide", _INCLUSION_PATTERNS)
@pytest.mark.parametrize("narrow", _INCLUSION_PATTERNS)
def test_dfa_includes_matches_the_complement_product(narrow: str, wide: str) -> None:
    a = expr_to_dfa(regex_search_expr(narrow, dialect="ecma"))
    b = expr_to_dfa(regex_search_expr(wide, dialect="ecma"))
    expected = dfa_is_empty(dfa_intersect(a, dfa_complement(b)))
    assert dfa_includes(a, b) is expected


def test_dfa_includes_gives_up_past_its_pair_limit() -> None:
    a = expr_to_dfa(regex_search_expr("^[a-y]{30}$", dialect="ecma"))
    b = expr_to_dfa(regex_search_expr("^[a-z]{30}$", dialect="ecma"))
    assert dfa_includes(a, b, max_pairs=5) is None
    assert dfa_includes(a, b) is True
    assert dfa_includes(b, a) is False
