"""Grammar core: a matcher's state on hand-built IR grammars: UTF-8 validity, empty and
unproductive languages, limits, rollback/fork/reset, EOS, padded vocabularies, forced strings."""

from __future__ import annotations

import numpy as np
import pytest
from grammar_support import tokenizer_info

from agent_infer.errors import GrammarDefinitionError, GrammarLimitError, MatcherUsageError
from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.ir import (
    Alt,
    CharClass,
    Expr,
    Grammar,
    Ref,
    Repeat,
    alt,
    chars,
    lit,
    plus,
    seq,
    star,
)
from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask
from agent_infer.grammar.runtime.matcher import GrammarMatcher

# Sums of integers, with a left-recursive sum rule.
LEFT_RECURSION = Grammar.from_rules(
    {
        "root": Ref("expr"),
        "expr": alt(seq(Ref("expr"), lit("+"), Ref("term")), Ref("term")),
        "term": plus(chars("0-9")),
    }
)


def _bits(bitmask: object, vocab: int) -> np.ndarray:
    words = bitmask[0].numpy().view(np.uint8)  # type: ignore[index]
    return np.unpackbits(words, bitorder="little")[:vocab].astype(bool)


@pytest.fixture(scope="module")
def byte_compiler() -> GrammarCompiler:
    return GrammarCompiler(TokenizerInfo.bytes_only())


def test_utf8_validity_bytes() -> None:
    """Only valid UTF-8 is accepted: no overlongs, no surrogates, nothing above U+10FFFF."""
    info = TokenizerInfo.bytes_only()
    compiled = GrammarCompiler(info).compile(Grammar.from_expr(star(CharClass(((0, 0x10FFFF),)))))
    m = GrammarMatcher(compiled)
    bitmask = allocate_token_bitmask(1, info.vocab_size)
    m.fill_next_token_bitmask(bitmask)
    bits = _bits(bitmask, info.vocab_size)
    allowed = {b for b in range(256) if bits[b]}
    assert allowed == set(range(0x80)) | set(range(0xC2, 0xF5))
    assert m.accept_token(0xED)
    m.fill_next_token_bitmask(bitmask)
    bits = _bits(bitmask, info.vocab_size)
    assert {b for b in range(256) if bits[b]} == set(range(0x80, 0xA0))  # no surrogates
    assert not m.accept_string(b"\xa0")
    assert m.accept_string(b"\x80")
    assert not m.can_terminate()  # U+D000 needs its third byte
    assert m.accept_string(b"\x80")
    assert m.can_terminate()
    assert not GrammarMatcher(compiled).accept_string(b"\xf4\x90")  # above U+10FFFF


def test_empty_language_raises(byte_compiler: GrammarCompiler) -> None:
    for grammar in (
        Grammar.from_expr(Alt(())),
        Grammar.from_expr(CharClass(())),
        Grammar.from_rules({"root": seq(lit("a"), Ref("r")), "r": seq(lit("b"), Ref("r"))}),
    ):
        with pytest.raises(GrammarDefinitionError):
            byte_compiler.compile(grammar)


def test_unproductive_branch_is_pruned(byte_compiler: GrammarCompiler) -> None:
    grammar = Grammar.from_rules(
        {"root": alt(lit("ok"), seq(lit("b"), Ref("r"))), "r": seq(lit("b"), Ref("r"))}
    )
    m = GrammarMatcher(byte_compiler.compile(grammar))
    assert not m.fork().accept_string("b")
    assert m.accept_string("ok") and m.can_terminate()


def test_huge_repeat_raises_limit(byte_compiler: GrammarCompiler) -> None:
    with pytest.raises(GrammarLimitError):
        byte_compiler.compile(Grammar.from_expr(Repeat(chars("a-z"), 0, 10**9)))
    with pytest.raises(GrammarLimitError):
        byte_compiler.compile(Grammar.from_expr(Repeat(chars("a-z"), 10**12, None)))
    deep: Expr = lit("x")
    for _ in range(5000):
        deep = Alt((deep, lit("y")))
    with pytest.raises(GrammarLimitError):
        byte_compiler.compile(Grammar.from_expr(deep))  # fails while fingerprinting
    with pytest.raises(GrammarLimitError):
        uncached = GrammarCompiler(byte_compiler.tokenizer_info, cache_enabled=False)
        uncached.compile(Grammar.from_expr(deep))  # fails in the native lowering
    small = GrammarCompiler(TokenizerInfo.bytes_only(), max_states=1000)
    with pytest.raises(GrammarLimitError):
        small.compile(Grammar.from_expr(Repeat(lit("ab"), 3000, 3000)))
    # A repeat of moderate size is fine.
    m = GrammarMatcher(byte_compiler.compile(Grammar.from_expr(Repeat(lit("ab"), 50, 50))))
    assert m.accept_string("ab" * 50) and m.can_terminate()


def test_per_step_work_limit() -> None:
    """A grammar whose Earley sets explode hits GrammarLimitError rather than running away."""
    compiler = GrammarCompiler(TokenizerInfo.bytes_only(), max_items_per_step=50)
    # s ::= s s | "a" is ambiguous; items per set grow with the input length.
    grammar = Grammar.from_rules({"root": Ref("s"), "s": alt(seq(Ref("s"), Ref("s")), lit("a"))})
    m = GrammarMatcher(compiler.compile(grammar))
    with pytest.raises(GrammarLimitError):
        for _ in range(200):
            m.accept_string("a")


def test_rollback_fork_reset(byte_compiler: GrammarCompiler) -> None:
    compiled = byte_compiler.compile(LEFT_RECURSION)
    m = GrammarMatcher(compiled)
    assert m.accept_string("12")
    assert m.accept_token(ord("+"))
    fork = m.fork()
    assert not m.accept_token(ord("+"))  # rejected: state unchanged
    assert m.accept_token(ord("3"))
    assert m.can_terminate() and not fork.can_terminate()
    m.rollback(2)
    assert m.can_terminate()  # back to "12"
    assert m.accept_token(ord("+")) and m.accept_token(ord("4"))
    assert fork.accept_token(ord("9")) and fork.can_terminate()
    with pytest.raises(MatcherUsageError, match="cannot roll back 10 tokens; only 3"):
        m.rollback(10)
    m.reset()
    assert not m.can_terminate() and not m.accept_token(ord("+"))
    limited = GrammarMatcher(compiled, max_rollback_tokens=1)
    assert limited.accept_token(ord("1")) and limited.accept_token(ord("2"))
    with pytest.raises(MatcherUsageError, match="cannot roll back 2 tokens; only 1"):
        limited.rollback(2)
    limited.rollback(1)
    assert limited.accept_token(ord("+"))


def test_eos_handling(byte_compiler: GrammarCompiler) -> None:
    compiled = byte_compiler.compile(LEFT_RECURSION)
    eos = 256
    m = GrammarMatcher(compiled)
    assert not m.accept_token(eos)
    assert m.accept_string("1")
    bitmask = allocate_token_bitmask(1, 257)
    m.fill_next_token_bitmask(bitmask)
    assert _bits(bitmask, 257)[eos]
    assert m.accept_token(eos) and m.is_terminated()
    assert not m.accept_token(ord("2")) and not m.accept_token(eos)
    m.fill_next_token_bitmask(bitmask)
    assert not _bits(bitmask, 257).any()
    m.rollback(1)
    assert not m.is_terminated() and m.accept_token(ord("2"))
    # terminate_without_eos: EOS never allowed; terminated once nothing may follow.
    fixed = byte_compiler.compile(Grammar.from_expr(lit("ab")))
    t = GrammarMatcher(fixed, terminate_without_eos=True)
    assert t.accept_string("ab")
    assert t.can_terminate() and t.is_terminated()
    assert not t.accept_token(eos)


def test_padded_vocab_ids_masked() -> None:
    info = TokenizerInfo([bytes([b]) for b in range(256)] + [b""], vocab_size=300, eos_token_ids=[256])
    m = GrammarMatcher(GrammarCompiler(info).compile(Grammar.from_expr(star(chars("a-z")))))
    bitmask = allocate_token_bitmask(1, info.vocab_size)
    m.fill_next_token_bitmask(bitmask)
    bits = _bits(bitmask, 320)
    assert not bits[257:].any() and bits[256] and bits[ord("q")]
    assert not m.accept_token(299)


def test_forced_string_and_tokens() -> None:
    info = tokenizer_info("deepseek")
    grammar = Grammar.from_expr(seq(lit('{"name": "'), plus(chars("a-z")), lit('", "ok": true}')))
    m = GrammarMatcher(GrammarCompiler(info).compile(grammar))
    assert m.find_forced_string() == '{"name": "'
    forced = m.forced_tokens()
    text = b"".join(info.token_bytes(t) for t in forced)
    assert forced and b'{"name": "'.startswith(text) and len(text) < len(b'{"name": "')
    for tid in forced:
        assert m.accept_token(tid)
    assert m.accept_string(text.decode()[0:0] + '{"name": "'[len(text) :] + "bob")
    assert m.find_forced_string() == ""  # more letters or the closing quote
    assert m.accept_string('"')
    assert m.find_forced_string() == ', "ok": true}'
    tail = m.forced_tokens()
    assert b"".join(info.token_bytes(t) for t in tail[:-1]) == b', "ok": true}'
    assert tail[-1] in info.eos_token_ids  # the grammar must end: everything is forced, EOS too
    for tid in tail:
        assert m.accept_token(tid)
    assert m.is_terminated()


def test_forced_string_partial_utf8() -> None:
    info = TokenizerInfo.bytes_only()
    grammar = Grammar.from_expr(seq(lit("é"), alt(lit("✓a"), lit("✓b"))))
    m = GrammarMatcher(GrammarCompiler(info).compile(grammar))
    assert m.find_forced_string() == "é✓"
    data, must_end = m.find_forced_bytes()
    assert data == "é✓".encode() and not must_end
