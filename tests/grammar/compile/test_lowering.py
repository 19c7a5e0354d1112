"""Native lowering: equal rules share one automaton, and merging never changes the language.

JSON Schema front ends emit one rule per subschema occurrence, so large schemas (Kubernetes)
carry thousands of copies of the same rules; the lowering merges rules whose programs are equal
up to the classes of the rules they reference (engine_native/src/grammar/lower/dedupe.cpp). These
tests pin that merging happens (state counts) and that it is exact (strings and token masks).
"""

from __future__ import annotations

import numpy as np
from grammar_support import hf_tokenizer, tokenizer_info

from agent_infer.grammar.compile.compiler import CompiledGrammar, GrammarCompiler
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.ir import Expr, Grammar, Ref, alt, chars, lit, plus, seq, star
from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask
from agent_infer.grammar.runtime.matcher import GrammarMatcher


def _item(digits: str) -> Expr:
    # A loop keeps the rule out of inlining, so each copy would be lowered separately.
    return seq(lit("k"), plus(chars(digits)), Ref("tail"))


TAIL = star(chars("xy"))


def _three(b_digits: str, c_digits: str) -> Grammar:
    return Grammar.from_rules(
        {
            "root": seq(Ref("a"), lit(","), Ref("b"), lit(","), Ref("c")),
            "a": _item("0-9"),
            "b": _item(b_digits),
            "c": _item(c_digits),
            "tail": TAIL,
        }
    )


SHARED = Grammar.from_rules(
    {"root": seq(Ref("a"), lit(","), Ref("a"), lit(","), Ref("a")), "a": _item("0-9"), "tail": TAIL}
)


def _compile(grammar: Grammar, info: TokenizerInfo | None = None) -> CompiledGrammar:
    compiler = GrammarCompiler(info or TokenizerInfo.bytes_only(), cache_enabled=False)
    return compiler.compile(grammar)


def _accepts(compiled: CompiledGrammar, text: str) -> bool:
    m = GrammarMatcher(compiled)
    return m.accept_string(text) and m.can_terminate()


def test_copies_of_a_rule_lower_to_one_automaton() -> None:
    copies = _compile(_three("0-9", "0-9"))
    shared = _compile(SHARED)
    distinct = _compile(_three("0-8", "0-7"))
    assert copies.num_states == shared.num_states
    assert distinct.num_states > copies.num_states
    for text in ["k1,k22,k333", "k1x,k2yy,k3xyx", "k0,k9x,k5"]:
        assert _accepts(copies, text), text
        assert _accepts(shared, text), text
    for text in ["k1,k2", "k,k1,k1", "k1,k2,k3,", "k1,k2,k3z"]:
        assert not _accepts(copies, text), text


def test_rules_differing_only_in_a_callee_stay_apart() -> None:
    """a and b have equal programs, but they call rules that differ: they must not merge."""
    grammar = Grammar.from_rules(
        {
            "root": seq(Ref("a"), lit("|"), Ref("b")),
            "a": seq(lit("k"), Ref("c")),
            "b": seq(lit("k"), Ref("d")),
            "c": plus(lit("1")),
            "d": plus(lit("2")),
        }
    )
    compiled = _compile(grammar)
    assert _accepts(compiled, "k1|k22")
    for text in ["k2|k1", "k1|k1", "k22|k22"]:
        assert not _accepts(compiled, text), text
    distinct = _compile(_three("0-8", "0-7"))
    assert not _accepts(distinct, "k9,k9,k1")
    assert not _accepts(distinct, "k1,k1,k9")
    assert _accepts(distinct, "k9,k8,k7")


def test_mutually_recursive_copies_merge() -> None:
    """a and b call each other with equal programs: the coarsest partition makes them one rule."""
    mutual = Grammar.from_rules(
        {
            "root": Ref("a"),
            "a": alt(seq(lit("("), Ref("b"), lit(")")), lit("x")),
            "b": alt(seq(lit("("), Ref("a"), lit(")")), lit("x")),
        }
    )
    single = Grammar.from_rules({"root": Ref("a"), "a": alt(seq(lit("("), Ref("a"), lit(")")), lit("x"))})
    m, s = _compile(mutual), _compile(single)
    assert m.num_states == s.num_states
    for text in ["x", "(x)", "(((x)))"]:
        assert _accepts(m, text), text
    for text in ["", "(x", "(())", "((x)"]:
        assert not _accepts(m, text), text


def test_merged_masks_equal_the_shared_grammar() -> None:
    """Token masks of the copies grammar equal those of the grammar written with one rule."""
    info = tokenizer_info("deepseek")
    copies = _compile(_three("0-9", "0-9"), info)
    shared = _compile(SHARED, info)
    text = "k12x,k3yy,k456xy"
    ids = hf_tokenizer("deepseek").encode(text, add_special_tokens=False).ids
    mc, ms = GrammarMatcher(copies), GrammarMatcher(shared)
    bc = allocate_token_bitmask(1, info.vocab_size)
    bs = allocate_token_bitmask(1, info.vocab_size)
    for tid in [*ids, None]:
        mc.fill_next_token_bitmask(bc)
        ms.fill_next_token_bitmask(bs)
        assert np.array_equal(np.asarray(bc), np.asarray(bs))
        if tid is not None:
            assert mc.accept_token(tid) and ms.accept_token(tid)
    assert mc.can_terminate() and ms.can_terminate()
