"""minLength/maxLength pushed into a pattern's repeats: same language as pattern ∩ length."""

from __future__ import annotations

import json
import random
import re

import pytest

from agent_infer.grammar import Grammar
from agent_infer.grammar.frontends.json_schema.types.lengths import bounded_pattern
from agent_infer.grammar.ir import CharClass, Literal, Repeat, Seq
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer

ALPHABET = 'ab-/.:_9Z"\\é'

# (pattern, minLength, maxLength, whether the bound moves into the expression)
CASES = [
    (r"^[a-z0-9-]+$", 0, 5, True),
    (r"^[a-z0-9-]+$", 3, 5, True),
    (r"^[a-z0-9-]*$", 2, None, True),
    (r"^[\w\/-]+$", 1, 4, True),
    (r"^([\w\/-]|[\w-][\w\/-]*[\w-])$", 0, 4, True),
    (r"^([\w\/-]|[\w-][\w\/-]*[\w-])$", 2, 5, True),
    (r"^a:[ab]{2,3}$", 0, 4, True),
    (r"^[^/]{2,6}$", 3, 4, True),
    (r"^(ab)+$", 3, 7, True),
    (r"^(ab)+$", 3, 3, True),
    (r"^[a-z]+$", 6, 2, True),
    (r"^\d{3}-[a-z]+$", 0, 3, True),
    (r"^[a-z]+:[a-z]+$", 0, 5, False),
    (r"ab", 0, 4, False),
    (r"^(a|bb)+$", 0, 5, False),
    # Every match is long enough already: the bound is dropped, no product.
    (r"^\S+$", 1, None, True),
    (r"^(?:\S+\s+){0,3}\S+$", 1, None, True),
    (r"^a{2}[ab]*$", 2, None, True),
]


def _strings(rng: random.Random, hi: int, n: int) -> list[str]:
    out = {""}
    while len(out) < n:
        out.add("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, hi + 2))))
    return sorted(out)


@pytest.mark.parametrize(("pattern", "lo", "hi", "pushed"), CASES)
def test_bounded_pattern_language(pattern: str, lo: int, hi: int | None, pushed: bool) -> None:
    schema: dict[str, object] = {"type": "string", "pattern": pattern, "minLength": lo}
    if hi is not None:
        schema["maxLength"] = hi
    grammar = Grammar.from_json_schema(schema, whitespace="compact")
    # The product automaton's states become rules named after the schema pointer ("str-N").
    product = any(re.search(r"(^|-)str(-\d+)?$", name) for name, _ in grammar.rules)
    assert product is not pushed, str(grammar)
    rec = ReferenceRecognizer(grammar)
    rx = re.compile(pattern, re.ASCII)
    rng = random.Random(f"{pattern}{lo}{hi}")
    words = _strings(rng, hi if hi is not None else 6, 400)
    # Also sample words of the pattern itself, which random strings rarely hit.
    words += ["a" * k for k in range(9)] + ["ab" * k for k in range(5)] + ["a-" * k + "a" for k in range(4)]
    words += ["123-ab", "123-a", "a:ab", "a:abb", "a/b", "/", "-/", "a/"]
    for w in words:
        want = rx.search(w) is not None and lo <= len(w) and (hi is None or len(w) <= hi)
        text = json.dumps(w)
        assert rec.accepts(text) is want, (w, text)
        if not w.isascii():
            assert rec.accepts(json.dumps(w, ensure_ascii=False)) is want, w


def test_long_bound_uses_counted_rules() -> None:
    # A bound far above the inline limit becomes chunk or doubling rules, never 10 000 copies.
    schema = {"type": "string", "pattern": "^[a-z]+$", "maxLength": 10000}
    grammar = Grammar.from_json_schema(schema, whitespace="compact")
    assert len(str(grammar)) < 5000
    rec = ReferenceRecognizer(grammar)
    assert rec.accepts(json.dumps("a" * 10000))
    assert not rec.accepts(json.dumps("a" * 10001))
    assert not rec.accepts(json.dumps(""))
    assert not rec.accepts(json.dumps("a1"))


def test_bounded_pattern_shapes() -> None:
    cls = CharClass(((97, 122),))
    assert bounded_pattern(Repeat(cls, 1, None), 0, 63) == Repeat(cls, 1, 63)
    assert bounded_pattern(Seq((Literal("ab"), Repeat(cls, 0, None))), 3, 5) == Seq(
        (Literal("ab"), Repeat(cls, 1, 3))
    )
    # Two open repeats share the bound: only the product automaton is exact.
    assert bounded_pattern(Seq((Repeat(cls, 1, None), Literal(":"), Repeat(cls, 1, None))), 0, 9) is None


@pytest.mark.parametrize("pattern", [r"^[a-z]+:[a-z.]+:([a-z]+)?:\d$", r"ab", r"^(a|bb)+$", r"[^/]"])
@pytest.mark.parametrize(("lo", "hi"), [(0, 7), (2, None), (3, 3), (0, None), (5, 2)])
def test_bound_length_equals_product(pattern: str, lo: int, hi: int | None) -> None:
    # The counter-specialised product is the general product, state for state and edge for edge,
    # also on complements (whose edges are not merged by construction).
    from agent_infer.grammar.automata import (
        dfa_bound_length,
        dfa_complement,
        dfa_intersect,
        dfa_length,
        expr_to_dfa,
    )
    from agent_infer.grammar.frontends.regex.search import regex_search_expr

    dfa = expr_to_dfa(regex_search_expr(pattern, dialect="ecma"))
    for a in (dfa, dfa_complement(dfa)):
        want = dfa_intersect(a, dfa_length(lo, hi))
        got = dfa_bound_length(a, lo, hi)
        assert (got.edges, got.accept) == (want.edges, want.accept)


def test_long_fixed_tail_keeps_the_product_and_its_limit() -> None:
    # (a|b)*a(a|b){14}: a counted repeat followed by 15 characters it may also match would
    # determinize into ~2^15 states per count; the product automaton's limit answers in the front
    # end, and the bound is counted at run time over the pattern's own automaton.
    cls = CharClass(((97, 98),))
    tail = Seq((Literal("a"), Repeat(cls, 14, 14)))
    assert bounded_pattern(Seq((Repeat(cls, 0, None), *tail.items)), 0, 400) is None
    g = Grammar.from_json_schema({"type": "string", "pattern": "^(a|b)*a(a|b){14}$", "maxLength": 400})
    assert "%max-length(400 " in str(g)
