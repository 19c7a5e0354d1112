"""The compile cache key: a digest of rule names and programs, kept on the (immutable) grammar."""

from __future__ import annotations

from grammar_support import tokenizer_info

from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.ir import CharClass, Grammar, Ref, Seq, lit


def _grammar(text: str = "ab") -> Grammar:
    return Grammar.from_rules([("root", Seq((lit("<"), Ref("body"), lit(">")))), ("body", lit(text))])


def test_equal_grammars_share_one_compiled_grammar_and_others_do_not() -> None:
    compiler = GrammarCompiler(tokenizer_info("smollm2"), cache_limit_bytes=10**9)
    first = compiler.compile(_grammar())
    assert compiler.compile(_grammar()) is first  # an equal grammar, a different object
    assert compiler.compile(_grammar("ba")) is not first
    # Same bodies under other rule names print differently: kept apart, as the fingerprint did.
    renamed = Grammar.from_rules([("root", Seq((lit("<"), Ref("other"), lit(">")))), ("other", lit("ab"))])
    assert compiler.compile(renamed) is not first
    # Rule order is part of the programs (references are rule indices).
    reordered = Grammar.from_rules([("body", lit("ab")), ("root", Seq((lit("<"), Ref("body"), lit(">"))))])
    assert reordered == _grammar()
    assert compiler.compile(reordered) is first


def test_key_is_computed_once_per_grammar_instance() -> None:
    compiler = GrammarCompiler(tokenizer_info("smollm2"), cache_limit_bytes=10**9)
    grammar = _grammar()
    compiler.compile(grammar)
    key = grammar.__dict__["_compile_key"]
    other = GrammarCompiler(tokenizer_info("smollm2"))
    other.compile(grammar)
    assert grammar.__dict__["_compile_key"] == key
    assert _grammar() == grammar and hash(_grammar()) == hash(grammar)  # not part of equality


def test_equivalent_class_spellings_share_automata() -> None:
    """[^a-z] and its ranges written out compile to the same programs, hence one cache entry."""
    compiler = GrammarCompiler(tokenizer_info("smollm2"), cache_limit_bytes=10**9)
    negated = Grammar.from_expr(CharClass(((0x61, 0x7A),), negated=True))
    spelled = Grammar.from_expr(CharClass(((0, 0x60), (0x7B, 0x10FFFF))))
    assert str(negated) != str(spelled)
    assert compiler.compile(negated) is compiler.compile(spelled)


def test_fingerprint_is_memoized_and_stable() -> None:
    grammar = _grammar()
    assert grammar.fingerprint() == grammar.fingerprint() == _grammar().fingerprint()
    assert grammar.__dict__["_fingerprint"] == grammar.fingerprint()
    assert grammar.fingerprint() != _grammar("ba").fingerprint()
