"""Native lowering passes around the automata: equal-rule merging, productivity, FOLLOW sets.

``grammar/lower/dedupe.cpp`` merges rules that are equal once references are replaced by their
targets' classes; after its first round it compares a class's members by their callees' classes
alone. ``grammar/lower/compile.cpp`` takes a rule lowered through the fragment store as productive
when every rule it calls is. ``grammar/lower/follow.cpp`` computes FIRST sets only for rule starts,
reference targets and what they depend on. The fragment store splits each distinct class once
per grammar and reuses a class's automaton before the same continuation. These tests pin the
observable results: merged chains cost the states of one chain, unproductive branches are
pruned (and an empty language is an error), the token masks next to rule boundaries are exact,
and equal, prefix-equal and empty classes in different rules keep their own languages.
"""

from __future__ import annotations

import pytest
from grammar_support import assert_mask_exact, tokenizer_info

from agent_infer.errors import AgentInferError
from agent_infer.grammar.compile.compiler import CompiledGrammar, GrammarCompiler
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.ir import CharClass, Expr, Grammar, Ref, Repeat, alt, chars, lit, seq
from agent_infer.grammar.runtime.matcher import GrammarMatcher


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


def test_equal_classes_in_different_rules_keep_their_languages() -> None:
    # The store splits a class once per distinct range list and reuses its automaton before the
    # same continuation (grammar/lower/nfa.cpp class_seqs, grammar/lower/fragment.cpp store_eval). Classes
    # that are equal, prefix-equal or empty must each keep their own language, in stored rules
    # (finite) and in looping ones (subset construction), before shared and distinct continuations.
    empty = CharClass(((0xD800, 0xDFFF),))  # surrogates only: no UTF-8 byte sequence
    rules: dict[str, Expr] = {
        "root": alt(
            seq(lit("1"), Ref("p")),
            seq(lit("2"), Ref("q")),
            seq(lit("3"), Ref("r")),
            seq(lit("4"), Ref("s")),
            seq(lit("5"), Ref("loop")),
        ),
        # An empty class right before a new one: both would start at the same split position.
        "p": alt(seq(empty, Ref("t")), seq(chars("a-c"), Ref("t"))),
        "q": alt(seq(chars("a-c"), Ref("t")), seq(chars("a-cx-z"), Ref("u"))),
        "r": seq(chars("a-cx-z"), Ref("t")),
        "s": seq(chars("a-c"), lit("!"), chars("a-c\u00e9"), Ref("u")),
        "loop": seq(Repeat(chars("a-c"), 1, None), Ref("t")),
        "t": alt(lit("."), Repeat(chars("a-c"), 2, None)),
        "u": lit(";"),
    }
    compiled = _compile(Grammar.from_rules(rules))
    cases = {
        "1a.": True,
        "1x.": False,
        "2c.": True,
        "2y;": True,
        "2y.": False,
        "2b;": True,
        "2d;": False,
        "3z.": True,
        "3zab": True,
        "3d.": False,
        "4a!\u00e9;": True,
        "4a!d;": False,
        "4a!b;": True,
        "5abc.": True,
        "5x.": False,
    }
    for text, expected in cases.items():
        assert _accepts(compiled, text) is expected, text
    m = GrammarMatcher(_compile(Grammar.from_rules(rules), tokenizer_info("smollm2")))
    for pos, text in enumerate(["4", "a", "!", "\u00e9", ";"]):
        assert_mask_exact(m, pos)
        assert m.accept_string(text), (pos, text)
    assert m.can_terminate()
