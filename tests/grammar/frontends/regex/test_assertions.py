"""Lookaheads and anchors away from a pattern's edges in JSON Schema patterns (regex/assertions.py):
the search language, built as an automaton and written back as an expression, equals Python
``re``'s on every short string over an alphabet that meets each pattern's cases. A whole-string
regex (a Lark terminal, ``Grammar.from_regex``) still refuses a lookahead."""

from __future__ import annotations

import itertools
import re

import pytest

from agent_infer.errors import UnsupportedRegexError
from agent_infer.grammar.automata import dfa_accepts, expr_to_dfa
from agent_infer.grammar.frontends.regex.parser import parse_regex
from agent_infer.grammar.frontends.regex.search import regex_search_expr

PATTERNS = [
    r"^(?!@@)[@a-z0-9_-]+$",
    r"^(?!ab$).*$",
    r"^(?!^ab\.|ba\.).*",
    r"^(\/?((\.{2})|([a-z0-9\-]*))($|\/))*$",
    r"/^[0-9]{2}$/",
    r"((?:[^/]*/)*)(?=\.(ab|b))",
    r"^@([\da-z](?:(?!.*--)[\da-z-]*[\da-z])?)/([\da-z]+)$",
    r"a(?=b)",
    r"a(?!b)",
    r"^(?=.{2,4}$)[ab]*c?$",
    r"(a$|b)a",
    r"^(a|$)b?",
    r"(?=ab)a",
    r"x(?=a|b$)",
    r"(?!a)",
]
ALPHABET = "ab.@/-0c"


def _strings(n: int) -> list[str]:
    return ["".join(t) for k in range(n + 1) for t in itertools.product(ALPHABET, repeat=k)]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_search_equals_python_re(pattern: str) -> None:
    dfa = expr_to_dfa(regex_search_expr(pattern, dialect="ecma"), 100_000)
    rx = re.compile(pattern)
    wrong = [t for t in _strings(5) if dfa_accepts(dfa, t) != (rx.search(t) is not None)]
    assert not wrong, wrong[:5]


def test_limits_and_what_stays_unsupported() -> None:
    with pytest.raises(UnsupportedRegexError, match="lookahead inside a lookahead"):
        regex_search_expr(r"(?=a(?=b))", dialect="ecma")
    with pytest.raises(UnsupportedRegexError, match="lookbehind"):
        regex_search_expr(r"(?<=a)b", dialect="ecma")
    with pytest.raises(UnsupportedRegexError, match="outside a JSON Schema pattern") as info:
        parse_regex(r"xy(?!b)")
    assert info.value.position == 2
