"""The grammar IR: construction, validation, GBNF printing, combinators."""

from __future__ import annotations

import pytest

from agent_infer.errors import GrammarDefinitionError
from agent_infer.grammar.ir import (
    Alt,
    CharClass,
    Empty,
    Grammar,
    Literal,
    Ref,
    Repeat,
    Seq,
    alt,
    chars,
    lit,
    opt,
    plus,
    seq,
    star,
)


def test_constructors_flatten_and_simplify() -> None:
    assert seq(lit("a"), Empty(), seq(lit("b"), lit("c"))) == Seq((Literal("a"), Literal("b"), Literal("c")))
    assert seq() == Empty()
    assert alt(lit("a"), alt(lit("b"), lit("a"))) == Alt((Literal("a"), Literal("b")))
    assert opt(lit("x")) == Repeat(Literal("x"), 0, 1)
    assert chars("a-c_") == CharClass(((97, 99), (95, 95)))


def test_gbnf_printing() -> None:
    g = Grammar.from_rules(
        {
            "root": seq(
                lit('say "hi"\n'), star(Ref("item")), opt(chars("0-9")), plus(chars("]-", negated=True))
            ),
            "item": alt(
                lit("a"), Repeat(chars("a-z"), 2, 4), Repeat(lit("q"), 3, 3), Repeat(lit("z"), 1, None)
            ),
        }
    )
    text = str(g)
    assert text.splitlines()[0] == 'root ::= "say \\"hi\\"\\n" item* [0-9]? [^\\]\\x2D]+'
    assert text.splitlines()[1] == 'item ::= "a" | [a-z]{2,4} | "q"{3} | "z"+'


def test_root_printed_first_and_fingerprint_stable() -> None:
    g = Grammar.from_rules([("b", lit("x")), ("root", Ref("b"))])
    assert str(g).startswith("root ::= b")
    assert g.fingerprint() == Grammar.from_rules([("b", lit("x")), ("root", Ref("b"))]).fingerprint()
    assert g.fingerprint() != Grammar.from_rules([("b", lit("y")), ("root", Ref("b"))]).fingerprint()


def test_validation_errors_name_the_problem() -> None:
    with pytest.raises(GrammarDefinitionError, match="undefined rule 'nope'"):
        Grammar.from_rules({"root": Ref("nope")})
    with pytest.raises(GrammarDefinitionError, match="root rule 'root'"):
        Grammar.from_rules({"start": lit("a")})
    with pytest.raises(GrammarDefinitionError, match="invalid rule name"):
        Grammar.from_rules({"root": lit("a"), "bad name": lit("b")})
    with pytest.raises(GrammarDefinitionError, match="repetition"):
        Repeat(lit("a"), 3, 2)
    with pytest.raises(GrammarDefinitionError, match="range"):
        CharClass(((5, 2),))


def test_charclass_normalization() -> None:
    assert CharClass(((5, 9), (0, 3), (4, 4))).normalized() == ((0, 9),)
    assert CharClass(((1, 0x10FFFE),), negated=True).normalized() == ((0, 0), (0x10FFFF, 0x10FFFF))


def test_union_and_concat_rename_rules() -> None:
    a = Grammar.from_rules({"root": Ref("x"), "x": lit("a")})
    b = Grammar.from_rules({"root": Ref("x"), "x": lit("b")})
    u = Grammar.union(a, b)
    assert u.rule("root") == Alt((Ref("g0-root"), Ref("g1-root")))
    assert u.rule("g1-x") == Literal("b")
    c = Grammar.concat(a, b)
    assert c.rule("root") == Seq((Ref("g0-root"), Ref("g1-root")))


def test_choice_and_builtin_errors() -> None:
    assert Grammar.choice(["yes", "no"]).rule("root") == Alt((Literal("yes"), Literal("no")))
    with pytest.raises(GrammarDefinitionError):
        Grammar.choice([])
    with pytest.raises(GrammarDefinitionError, match="no built-in grammar"):
        Grammar.builtin("definitely_not_a_grammar")
