"""Lark front end: rules and terminals, %ignore, %import common, and errors with positions."""

from __future__ import annotations

import random

import pytest

from agent_infer.errors import GrammarDefinitionError, GrammarSyntaxError
from agent_infer.grammar.frontends.ebnf.lark_grammar import parse_lark
from agent_infer.grammar.ir import Grammar
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer
from agent_infer.testing import random_strings

CALC = r"""
?start: sum
?sum: product
    | sum "+" product   -> add
    | sum "-" product   -> sub
?product: atom
    | product "*" atom  -> mul
?atom: NUMBER | "-" atom | NAME | "(" sum ")"
NAME: /[a-z_]\w*/i
%import common.NUMBER
%import common.WS_INLINE
%ignore WS_INLINE
"""

JSONISH = r"""
start: value
?value: dict | list | ESCAPED_STRING | SIGNED_NUMBER | "true" | "false" | "null"
list : "[" [value ("," value)*] "]"
dict : "{" [pair ("," pair)*] "}"
pair : ESCAPED_STRING ":" value
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
"""


def _rec(text: str, **kwargs: str) -> ReferenceRecognizer:
    return ReferenceRecognizer(parse_lark(text, **kwargs))


def test_calculator_with_ignore_and_left_recursion() -> None:
    rec = _rec(CALC)
    for ok in ["1", "1+2*3", " 1 +  x * ( y_2 - 3.5e2 ) ", "-x", "Foo*2"]:
        assert rec.accepts(ok), ok
    for bad in ["", "1+", "1 2", "(1", "1\n+2", "2x"]:
        assert not rec.accepts(bad), bad


def test_ignored_tokens_stay_between_tokens_only() -> None:
    rec = _rec('start: WORD "=" WORD\nWORD: /[a-z]+/\n%ignore " "\n')
    assert rec.accepts("ab = cd") and rec.accepts(" ab=cd ")
    assert not rec.accepts("a b = cd")  # a space may not split a token


def test_jsonish_with_common_imports() -> None:
    rec = _rec(JSONISH)
    for ok in ['{"a": [1, -2.5e3, true, null], "b\\"c": {}}', "[]", '"x"', "[ ]"]:
        assert rec.accepts(ok), ok
    for bad in ['{"a" 1}', '"unterminated', '"a"b"', "[1,]", "01x"]:
        assert not rec.accepts(bad), bad


def test_terminal_features() -> None:
    text = r"""
start: GREETING " " NAME [ "!" ] DIGITS
GREETING: "hello"i | "hi"
NAME: ("a".."z")+
DIGITS: "0".."9" ~ 2..3
"""
    rec = _rec(text)
    assert rec.accepts("HeLLo bob!12") and rec.accepts("hi x123")
    assert not rec.accepts("HI x12") and not rec.accepts("hello bob1") and not rec.accepts("hello bob1234")


def test_common_terminals_match_lark_definitions() -> None:
    grammar = parse_lark(
        "start: INT | FLOAT | CNAME | HEXDIGIT | NEWLINE | C_COMMENT\n"
        "%import common (INT, FLOAT, CNAME, HEXDIGIT, NEWLINE, C_COMMENT)\n"
    )
    rec = ReferenceRecognizer(grammar)
    for ok in ["42", "1.5", "1e10", ".5", "2.", "_x9", "f", "\r\n\n", "/* a * b */", "/***/"]:
        assert rec.accepts(ok), ok
    for bad in ["1.5.2", "9x", "/* a */ */", "$", "1_"]:
        assert not rec.accepts(bad), bad


def test_import_alias_and_rule_modifiers() -> None:
    rec = _rec('!start: _item+\n_item: N ","?\n%import common.INT -> N\n')
    assert rec.accepts("1,23,4") and not rec.accepts(",")


def test_start_and_from_ebnf() -> None:
    g = Grammar.from_ebnf('main: "a"+\n', syntax="lark", start="main")
    assert ReferenceRecognizer(g).accepts("aaa")


@pytest.mark.parametrize(
    ("text", "line", "column", "words"),
    [
        ('start: "a"\n%declare FOO\n', 2, 1, "%declare"),
        ("start: x{1}\n", 1, 8, "template"),
        ("start{a}: a\n", 1, 6, "template"),
        ('start: ( "a"\n', 2, 1, "expected ')'"),
        ('start: "a" /a(?=b)/\n', 1, 12, "lookahead"),
        ("%import common.FOO\nstart: INT\n", 1, 9, "common.FOO"),
        ("%import other.X\nstart: X\n", 1, 9, "only '%import common"),
        ('start: A\nA: a\na: "x"\n', 2, 4, "cannot refer to rule"),
        ('start: "a"\nstart: "b"\n', 2, 1, "defined twice"),
    ],
)
def test_errors_have_line_and_column(text: str, line: int, column: int, words: str) -> None:
    with pytest.raises(GrammarSyntaxError) as info:
        parse_lark(text)
    assert (info.value.line, info.value.column) == (line, column), str(info.value)
    assert words in str(info.value)


def test_undefined_names() -> None:
    with pytest.raises(GrammarDefinitionError, match=r"'thing'.*line 2"):
        parse_lark('start: "a"\n  | thing\n')
    with pytest.raises(GrammarDefinitionError, match="start rule"):
        parse_lark('begin: "a"\n')


@pytest.mark.parametrize("text", [CALC, JSONISH], ids=["calc", "jsonish"])
def test_agrees_with_lark_itself(text: str) -> None:
    """Generated strings and one-character mutations: same verdict as lark's own Earley parser."""
    lark = pytest.importorskip("lark")
    ours = ReferenceRecognizer(parse_lark(text))
    theirs = lark.Lark(text, parser="earley", lexer="dynamic")
    rng = random.Random(1)
    for sample in random_strings(parse_lark(text), 20, seed=3, max_depth=5, max_repeat=3):
        i = rng.randrange(len(sample) + 1)
        mutated = sample[:i] + rng.choice('1a +-()"[],:e.') + sample[i + 1 :]
        for candidate in (sample, mutated):
            try:
                theirs.parse(candidate)
                lark_ok = True
            except lark.exceptions.LarkError:
                lark_ok = False
            assert ours.accepts(candidate) == lark_ok, candidate
