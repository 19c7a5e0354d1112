"""Run-time checks whose items reach rules the matcher judges itself (``UniqueItem``,
``BoundedString``): the shadow copies keep those marks, a product keeps such a rule as a call,
and a product that would have to expand one is a limit error.

The native matcher is compared with the reference recognizer on every short string over each
grammar's characters, and its masks with ``accept_token`` along the texts (bytes vocabulary).
"""

from __future__ import annotations

import itertools

import pytest
from grammar_support import assert_mask_exact, tokenizer_info

from agent_infer.errors import GrammarLimitError
from agent_infer.grammar import Grammar, GrammarCompiler, GrammarMatcher
from agent_infer.grammar.frontends.ebnf.gbnf import parse_gbnf
from agent_infer.grammar.ir import BoundedString, Check, Expr, Ref, UniqueItem, chars, lit, plus, seq, star
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer

DIGITS = plus(chars("0-9"))
WORD = seq(lit('"'), star(chars("ab")), lit('"'))


def _list(item: Expr, open_: str = "[", sep: str = ",", close: str = "]") -> Expr:
    return seq(lit(open_), item, star(seq(lit(sep), item)), lit(close))


# name -> (rules, characters to draw strings from, texts along which masks are compared)
CASES: dict[str, tuple[dict[str, Expr], str, list[str]]] = {
    # Lists of digit strings holding a duplicate: the shadow item is a unique list, so its copy
    # must reject duplicates too.
    "not_unique": (
        {
            "root": seq(lit("("), Ref("c"), lit(")")),
            "c": Check((Ref("s"), Ref("n")), 1, (0b01,)),
            "s": _list(DIGITS),
            "n": _list(Ref("u")),
            "u": UniqueItem(DIGITS),
        },
        "()[12,]",
        ["([1,1])", "([1,2])", "([12,1,12])", "([2,1,2,1])"],
    ),
    # Lists of strings one of which passes two characters: the shadow item bounds each string.
    "not_bounded": (
        {
            "root": seq(lit("("), Ref("c"), lit(")")),
            "c": Check((Ref("s"), Ref("n")), 1, (0b01,)),
            "s": _list(WORD),
            "n": _list(Ref("b")),
            "b": BoundedString(WORD, 2),
        },
        '()[]",ab',
        ['(["ab"])', '(["aba"])', '(["a","bbb"])', '(["","abab"])'],
    ),
    # A product whose items read their strings through one bounded rule: kept as a call, so every
    # item's strings are bounded by the matcher (groups of exactly one short string).
    "product_call": (
        {
            "root": _list(Ref("c")),
            "c": Check((Ref("s"), Ref("n")), 1, (0b01,), True),
            "s": _list(Ref("b"), "<", ";", ">"),
            "n": seq(lit("<"), Ref("b"), lit(";"), Ref("b"), star(seq(lit(";"), Ref("b"))), lit(">")),
            "b": BoundedString(WORD, 2),
        },
        '[]<>;"ab,',
        ['[<"ab">]', '[<"aba">]', '[<"a";"b">]', '[<"">,<"b">]'],
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_native_agrees_with_the_reference(name: str) -> None:
    rules, alphabet, texts = CASES[name]
    g = Grammar.from_rules(rules)
    assert parse_gbnf(str(g)) == g
    rec = ReferenceRecognizer(g)
    compiled = GrammarCompiler(tokenizer_info("bytes")).compile(g)
    candidates = {t[:cut] for t in texts for cut in range(len(t) + 1)}
    candidates |= {"".join(p) for n in range(1, 5) for p in itertools.product(alphabet, repeat=n)}
    for text in sorted(candidates):
        m = GrammarMatcher(compiled)
        complete = m.accept_string(text) and m.can_terminate()
        assert complete == rec.accepts(text), text
    assert any(rec.accepts(t) for t in texts) and not all(rec.accepts(t) for t in texts)


@pytest.mark.parametrize("name", sorted(CASES))
def test_masks_exact_bytes(name: str) -> None:
    rules, _, texts = CASES[name]
    compiled = GrammarCompiler(tokenizer_info("bytes")).compile(Grammar.from_rules(rules))
    for text in texts:
        m = GrammarMatcher(compiled)
        for pos, b in enumerate(text.encode()):
            assert_mask_exact(m, pos)
            if not m.accept_token(b):
                break
        else:
            assert_mask_exact(m, len(text))


@pytest.mark.parametrize(
    ("rules", "why"),
    [
        # The other item reads digits itself where the unique rule is called: it would be expanded.
        (
            {
                "root": _list(Ref("c")),
                "c": Check((Ref("s"), Ref("n")), 1, (0b01,), True),
                "s": _list(DIGITS, "<", ";", ">"),
                "n": _list(Ref("u"), "<", ";", ">"),
                "u": UniqueItem(DIGITS),
            },
            "another item reads a unique array item or a max-length string another way",
        ),
        # An item that is itself a bounded string.
        (
            {
                "root": _list(Ref("c")),
                "c": Check((Ref("s"), Ref("b")), 1, (0b01,), True),
                "s": WORD,
                "b": BoundedString(WORD, 1),
            },
            "an item is a unique array item or a max-length string",
        ),
    ],
)
def test_a_product_that_would_lose_a_mark_is_a_limit_error(rules: dict[str, Expr], why: str) -> None:
    with pytest.raises(GrammarLimitError, match=rf"rule .c. cannot be compiled to one automaton: {why}"):
        GrammarCompiler(tokenizer_info("bytes")).compile(Grammar.from_rules(rules))
