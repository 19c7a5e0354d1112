"""Grammar validation (``ir/references.py``): the first undefined reference and rule-name checks,
the native walk and the Python walk giving the same first error."""

from __future__ import annotations

import pytest

from agent_infer.errors import GrammarDefinitionError
from agent_infer.grammar.ir import Alt, Empty, Grammar, Ref, Seq, lit, seq
from agent_infer.grammar.ir.references import _undefined_ref, first_undefined_ref


def test_first_undefined_reference_in_rule_then_walk_order() -> None:
    """The reported name is the one a pre-order walk with the last child first meets first."""
    shared = Seq((Ref("ok"), Ref("m1")))
    rules = (
        ("root", Seq((Ref("ok"), lit("x")))),
        ("ok", Alt((shared, Seq((Ref("m2"), shared)), Ref("m3")))),
    )
    names = {"root", "ok"}
    assert _undefined_ref(rules[1][1], names) == "m3"
    assert first_undefined_ref(rules, names) == ("ok", "m3")
    with pytest.raises(GrammarDefinitionError, match="rule 'ok' refers to undefined rule 'm3'"):
        Grammar(rules)
    with pytest.raises(GrammarDefinitionError, match="rule 'root' refers to undefined rule 'm0'"):
        Grammar((("root", seq(Ref("m0"), Ref("ok"))), ("ok", Empty())))


def test_rule_name_checks_report_the_first_problem() -> None:
    with pytest.raises(GrammarDefinitionError, match="rule 'a' is defined twice"):
        Grammar((("root", lit("x")), ("a", lit("y")), ("a", lit("z")), ("b c", lit("w"))))
    with pytest.raises(GrammarDefinitionError, match="invalid rule name 'b c'"):
        Grammar((("root", lit("x")), ("b c", lit("w")), ("a", lit("y")), ("a", lit("z"))))
    assert Grammar((("root", Ref("b-1_Z")), ("b-1_Z", lit("q")))).rules[1][0] == "b-1_Z"
