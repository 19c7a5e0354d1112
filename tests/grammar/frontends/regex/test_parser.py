"""Regex front end: differential tests against Python's ``re.fullmatch`` and error positions."""

from __future__ import annotations

import itertools
import random
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_infer.errors import GrammarSyntaxError, UnsupportedRegexError
from agent_infer.grammar.frontends.regex.parser import parse_regex, regex_to_grammar
from agent_infer.grammar.frontends.regex.search import regex_search_expr
from agent_infer.grammar.ir import Grammar
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer
from agent_infer.testing import assert_accepts, assert_rejects, strings

PATTERNS = [
    r"a|b",
    r"(ab|a)*b?",
    r"[a-c]{2,3}",
    r"a*a",
    r"(a|)+b",
    r"x{,2}y",
    r"x{2,}",
    r"[^a]b",
    r"(?i)Ab",
    r"(?i:a)B",
    r"\d\w\s",
    r"[\d\s]+",
    r"[^\W\d]+",
    r"(a*)*",
    r"a{0}b",
    r"^(?:ab)+$",
    r"\Aa+\Z",
    r"(?P<x>a)(?P<y>b)?",
    r"a.b",
    r"(?s)a.b",
    r"[]a]+",
    r"[a-]+",
    r"[-a]",
    r"a{",
    r"a{1,x}",
    r"\x41\u0042\U00000043\n?",
    r"\.\*\\",
    r"[.*+?]",
    r"a*?b+?c??",
    r"(?x) a  b # comment",
    r"(?#note)ab",
    r"(a|b|c)(a|b|c)",
    r"\0?[\t ]",
]
ALPHABET = "abcxyAB 1_\n.*\\{}-]\t"


def _short_strings() -> list[str]:
    return ["".join(t) for n in range(4) for t in itertools.product("abxAB1 \n", repeat=n)]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_matches_like_re_fullmatch(pattern: str) -> None:
    rec = ReferenceRecognizer(regex_to_grammar(pattern))
    compiled = re.compile(pattern)
    extra = ["a{", "a{1,x}", "ABC", "a\nb", "]]a", "a-", "ab.*\\", "\x00\t", "xxxy", "\\"]
    for text in [*_short_strings(), *extra]:
        assert rec.accepts(text) == bool(compiled.fullmatch(text)), (pattern, text)


@pytest.mark.parametrize("pattern", [p for p in PATTERNS if "(?i" not in p])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_drawn_strings_fullmatch(pattern: str, data: st.DataObject) -> None:
    text = data.draw(strings(pattern, kind="regex", max_repeat=4))
    assert re.fullmatch(pattern, text), (pattern, text)
    other = data.draw(st.text(alphabet=ALPHABET, max_size=6))
    assert ReferenceRecognizer(regex_to_grammar(pattern)).accepts(other) == bool(re.fullmatch(pattern, other))


@pytest.mark.parametrize("letter", ["d", "w", "s", "D", "W", "S"])
def test_unicode_shorthands_agree_with_re(letter: str) -> None:
    expr = parse_regex(f"\\{letter}")
    rec = ReferenceRecognizer(Grammar.from_expr(expr))
    for cp in [*range(0, 0x250), 0x660, 0x6F0, 0x1680, 0x2028, 0x3000, 0x4E00, 0xFEFF, 0x1D7CE, 0x10FFFF]:
        assert rec.accepts(chr(cp)) == bool(re.fullmatch(f"\\{letter}", chr(cp))), hex(cp)


def test_ecma_dialect() -> None:
    digits = ReferenceRecognizer(Grammar.from_expr(parse_regex(r"\d+", dialect="ecma")))
    assert digits.accepts("123") and not digits.accepts("١٢")  # ASCII \d only
    space = ReferenceRecognizer(Grammar.from_expr(parse_regex(r"\s", dialect="ecma")))
    assert all(space.accepts(c) for c in "\t\n\v\f\r \xa0\u2028\ufeff") and not space.accepts("\x1c")
    esc = ReferenceRecognizer(Grammar.from_expr(parse_regex(r"\u{1F600}\u00e9\ud83d\ude00", dialect="ecma")))
    assert esc.accepts("\U0001f600é\U0001f600")
    letters = ReferenceRecognizer(Grammar.from_expr(parse_regex(r"\p{Lu}+", dialect="ecma")))
    assert letters.accepts("ÀB") and not letters.accepts("a")
    dot = ReferenceRecognizer(Grammar.from_expr(parse_regex(r".", dialect="ecma")))
    assert dot.accepts("x") and not dot.accepts("\r") and not dot.accepts("\u2028")


@pytest.mark.parametrize(
    ("pattern", "inside", "outside"),
    [
        ("ab", ["ab", "xaby", "ab\n"], ["a", "ba"]),
        ("^ab", ["ab", "abzz"], ["xab"]),
        ("ab$", ["ab", "zzab"], ["abz"]),
        ("^ab$", ["ab"], ["abab", "xab"]),
        ("^a|b$", ["ax", "xb"], ["xa", "bx"]),
        ("(^a|b)c", ["acz", "zbc"], ["zac"]),
        ("", ["", "anything"], []),
    ],
)
def test_search_form(pattern: str, inside: list[str], outside: list[str]) -> None:
    rec = ReferenceRecognizer(Grammar.from_expr(regex_search_expr(pattern)))
    for text in inside:
        assert rec.accepts(text) and re.search(pattern, text), text
    for text in outside:
        assert not rec.accepts(text) and not re.search(pattern, text), text


@pytest.mark.parametrize(
    ("pattern", "position", "construct"),
    [
        (r"a(?=b)", 1, "lookahead"),
        (r"a(?!b)", 1, "negative lookahead"),
        (r"xy(?<=b)", 2, "lookbehind"),
        (r"(?<!b)c", 0, "negative lookbehind"),
        (r"(a)\1", 3, "backreference"),
        (r"(?P<n>a)(?P=n)", 8, "named backreference"),
        (r"ab\bc", 2, "word boundary"),
        (r"\Bx", 0, "word boundary"),
        (r"(a)?(?(1)b|c)", 4, "conditional"),
        (r"a^b", 1, "anchor"),
        (r"a$b", 1, "anchor"),
        (r"(?>a)", 0, "atomic"),
    ],
)
def test_unsupported_constructs_name_position(pattern: str, position: int, construct: str) -> None:
    with pytest.raises(UnsupportedRegexError) as info:
        parse_regex(pattern)
    assert info.value.position == position
    assert construct in str(info.value)


@pytest.mark.parametrize(
    ("pattern", "position"),
    [("(ab", 0), ("[ab", 0), ("a**", 2), ("*a", 0), ("a{3,1}", 1), (r"\q", 0), ("ab)", 2), (r"\x4", 0)],
)
def test_syntax_errors_have_position(pattern: str, position: int) -> None:
    with pytest.raises(GrammarSyntaxError) as info:
        parse_regex(pattern)
    assert info.value.position == position
    with pytest.raises(re.error):
        re.compile(pattern)


def test_literals_merge_and_print_as_gbnf() -> None:
    assert str(regex_to_grammar(r"^abc[0-9]+$")) == 'root ::= "abc" [0-9]+\n'
    assert Grammar.from_regex("a|b") == regex_to_grammar("a|b")


def test_native_matcher_agrees_with_re() -> None:
    texts = ["".join(t) for n in range(3) for t in itertools.product("abA1 \n", repeat=n)]
    for pattern in PATTERNS:
        grammar = regex_to_grammar(pattern)
        for text in texts:
            if re.fullmatch(pattern, text):
                assert_accepts(grammar, text, backend="native")
            else:
                assert_rejects(grammar, text, backend="native")


@pytest.mark.parametrize(
    "pattern", ["(?i)k", "(?i)s", "(?i)[a-z]+", "(?i)é", "(?i)[α-ω]", "(?i)[^k]", "(?i)ǅ", "(?i)i"]
)
def test_ignorecase_matches_re_beyond_ascii(pattern: str) -> None:
    rec = ReferenceRecognizer(regex_to_grammar(pattern))
    for cp in [*range(0x20, 0x250), *range(0x370, 0x400), 0x1E9E, 0x212A, 0x212B, 0x2126, 0x1C4, 0x1C6]:
        assert rec.accepts(chr(cp)) == bool(re.fullmatch(pattern, chr(cp))), (pattern, hex(cp))


def test_random_patterns_agree_with_re() -> None:
    """Random splices of regex fragments: we reject exactly what re rejects (or say unsupported)
    and otherwise match the same strings."""
    rng = random.Random(5)
    atoms = [
        *"ab.|()^$*+?{}[]-",
        "[ab]",
        "[^a]",
        r"\d",
        r"\w",
        r"\s",
        "(a|b)",
        "(?:ab)",
        "[a-c]",
        r"\.",
        "[]]",
    ]
    atoms += ["{1}", "{1,2}", "{,2}", r"\b", r"\1", r"\n", "(?i)", r"[\d-z]", "[a-]", "(?P<g>", "(?=", "a"]
    texts = ["".join(t) for n in range(4) for t in itertools.product("ab1 \n]", repeat=n)]
    for _ in range(150):
        pattern = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 5)))
        try:
            compiled = re.compile(pattern)
        except re.error:
            with pytest.raises(GrammarSyntaxError):
                regex_to_grammar(pattern)
            continue
        try:
            rec = ReferenceRecognizer(regex_to_grammar(pattern))
        except UnsupportedRegexError:
            continue
        for text in texts:
            assert rec.accepts(text) == bool(compiled.fullmatch(text)), (pattern, text)


def test_random_search_forms_agree_with_re_search() -> None:
    """The search form drops optional heads and tails next to its ``.*`` padding
    (``X Y? .*`` = ``X .*``); random patterns with optional parts, anchors and alternations
    must still contain exactly the strings ``re.search`` finds a match in."""
    rng = random.Random(11)
    atoms = [
        "a",
        "b",
        "1",
        "[ab]",
        "(a|)",
        "(ab)?",
        "b*",
        "[ab]+",
        "(a|b?)",
        "(?:a1|b)",
        "a{0,2}",
        "(b|a{2,3})",
        " ",
    ]
    texts = ["".join(t) for n in range(6) for t in itertools.product("ab1 ", repeat=n)]
    for _ in range(120):
        body = "".join(rng.choice(atoms) for _ in range(rng.randint(1, 4)))
        if rng.random() < 0.3:
            body = body + "|" + "".join(rng.choice(atoms) for _ in range(rng.randint(1, 3)))
        pattern = ("^" if rng.random() < 0.25 else "") + body + ("$" if rng.random() < 0.25 else "")
        if rng.random() < 0.2:
            pattern = "^" + rng.choice(atoms) + "|" + body + "$"
        compiled = re.compile(pattern)
        rec = ReferenceRecognizer(Grammar.from_expr(regex_search_expr(pattern)))
        for text in texts:
            assert rec.accepts(text) == bool(compiled.search(text)), (pattern, text)


def test_search_form_drops_an_optional_tail() -> None:
    """A URL-like pattern whose tail is optional is searched for by its head alone: the
    automaton stays small instead of tracking every way the tail could go on."""
    tail = r"(?:/(?:[a-z0-9]|%[0-9A-F]{2})*)*(?:\?[a-z=&]*)?(?:#[a-z]*)?"
    expr = regex_search_expr(r"([a-z][a-z0-9+.-]*):" + tail)
    assert expr == regex_search_expr(r"[a-z][a-z0-9+.-]*:")
    rec = ReferenceRecognizer(Grammar.from_expr(expr))
    assert rec.accepts("see http://x.org/a%2Fb?q=1#top") and not rec.accepts("no scheme here")
