"""Native lowering passes around the automata: equal-rule merging, productivity, FOLLOW sets.

``grammar_dedupe.cpp`` merges rules that are equal once references are replaced by their
targets' classes; after its first round it compares a class's members by their callees' classes
alone. ``grammar_compile.cpp`` takes a rule lowered through the fragment store as productive
when every rule it calls is. ``grammar_follow.cpp`` computes FIRST sets only for rule starts,
reference targets and what they depend on. These tests pin the observable results: merged
chains cost the states of one chain, unproductive branches are pruned (and an empty language is
an error), and the token masks next to rule boundaries are exact.
"""

from __future__ import annotations

import pytest
from test_grammar_core_support import assert_mask_exact, tokenizer_info

from agent_infer.errors import AgentInferError
from agent_infer.grammar.compiler import CompiledGrammar, GrammarCompiler
from agent_infer.grammar.ir import Expr, Grammar, Ref, Repeat, alt, chars, lit, seq
from agent_infer.grammar.matcher import GrammarMatcher
from agent_infer.grammar.tokenizer_info import TokenizerInfo


def _compile(grammar: Grammar, info: TokenizerInfo | None = None) -> CompiledGrammar:
    return GrammarCompiler(info or TokenizerInfo.bytes_only(), cache_enabled=False).compile(grammar)


def _accepts(compiled: CompiledGrammar, text: str) -> bool:
    m = GrammarMatcher(compiled)
    return m.accept_string(text) and m.can_terminate()


def _chain(prefix: str, n: int, last: str) -> dict[str, Expr]:
    """n rules, each `[a-c]*` then "," then the next rule (the last: the literal `last`). The
    loop keeps every rule separate (not inlined), so merging shows in the state count."""
    rules: dict[str, Expr] = {}
    for i in range(n):
        rest: Expr = Ref(f"{prefix}{i + 1}") if i + 1 < n else lit(last)
        rules[f"{prefix}{i}"] = seq(Repeat(chars("a-c"), 0, None), lit(","), rest)
    return rules


def test_equal_chains_merge_and_different_ones_do_not() -> None:
    n = 12
    single = _compile(
        Grammar.from_rules({"root": alt(Ref("a0"), seq(lit("!"), Ref("a0"))), **_chain("a", n, "x")})
    )
    twin = _compile(
        Grammar.from_rules(
            {"root": alt(Ref("a0"), seq(lit("!"), Ref("b0"))), **_chain("a", n, "x"), **_chain("b", n, "x")}
        )
    )
    # Equal chains (rule by rule, up to the classes of their callees) are lowered once.
    assert twin.num_states == single.num_states, (twin.num_states, single.num_states)
    # Chains that differ only at their far end share no rule: every rule's callee differs.
    apart = _compile(
        Grammar.from_rules(
            {"root": alt(Ref("a0"), seq(lit("!"), Ref("b0"))), **_chain("a", n, "x"), **_chain("b", n, "y")}
        )
    )
    assert apart.num_states > single.num_states, (apart.num_states, single.num_states)
    body = "ab," + "," * (n - 2) + "cc,"
    for compiled, bang_end in ((single, "x"), (twin, "x"), (apart, "y")):
        assert _accepts(compiled, body + "x")
        assert _accepts(compiled, "!" + body + bang_end)
        other = "y" if bang_end == "x" else "x"
        assert not _accepts(compiled, "!" + body + other)
        assert not _accepts(compiled, body + "y")
        assert not _accepts(compiled, body[:-1] + "x")


def test_stored_rule_calling_an_unproductive_rule_keeps_its_other_branch() -> None:
    # f is finite (lowered through the store) but calls r, whose language is empty (it never ends).
    rules: dict[str, Expr] = {
        "root": alt(lit("ok"), seq(lit("<"), Ref("f"), lit(">"))),
        "f": alt(seq(lit("x"), Ref("r")), lit("y")),
        "r": seq(lit("b"), Ref("r")),
    }
    compiled = _compile(Grammar.from_rules(rules))
    assert _accepts(compiled, "ok")
    assert _accepts(compiled, "<y>")
    m = GrammarMatcher(compiled)
    assert m.accept_string("<")
    assert not m.fork().accept_string("x")  # the dead branch is trimmed: no viable prefix through it
    assert m.accept_string("y>") and m.can_terminate()


def test_empty_language_through_a_stored_rule_is_an_error() -> None:
    rules: dict[str, Expr] = {
        "root": seq(lit("<"), Ref("f")),
        "f": seq(lit("x"), Ref("r")),
        "r": seq(lit("b"), Ref("r")),
    }
    with pytest.raises(AgentInferError):
        _compile(Grammar.from_rules(rules))


def test_masks_exact_at_rule_boundaries() -> None:
    # Nullable callees, accepting states followed by their callers' continuations, and a rule
    # called from several places (FOLLOW is the union of what comes after each call).
    rules: dict[str, Expr] = {
        "root": seq(Ref("item"), Repeat(seq(lit(", "), Ref("item")), 0, 3), Ref("tail")),
        "item": alt(seq(lit("k"), Ref("opt"), lit("=")), seq(lit("'"), Ref("word"), lit("'"))),
        "opt": Repeat(chars("0-9"), 0, 2),
        "word": Repeat(chars("a-z"), 1, None),
        "tail": alt(Repeat(lit(";"), 0, 1), seq(lit(" #"), Ref("word"))),
    }
    compiled = _compile(Grammar.from_rules(rules), tokenizer_info("smollm2"))
    m = GrammarMatcher(compiled)
    for pos, text in enumerate(["k", "1", "=", ", 'ab", "'", " #", "x"]):
        assert_mask_exact(m, pos)
        assert m.accept_string(text), (pos, text)
    assert_mask_exact(m, 99)
    assert m.can_terminate()
