"""Grammar core: matcher semantics and mask exactness on hand-built IR grammars.

Oracles: the third-party ``regex`` module's partial matching for regular grammars, a hand-written
checker for balanced parentheses, and, for masks, the matcher's own ``accept_token`` on a fork
(itself cross-checked against the oracles through ``accept_string``).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest
import regex
from grammar_support import hf_tokenizer, tokenizer_info

from agent_infer.errors import GrammarDefinitionError, GrammarLimitError, MatcherUsageError
from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.ir import (
    Alt,
    CharClass,
    Empty,
    Expr,
    Grammar,
    Ref,
    Repeat,
    alt,
    chars,
    lit,
    opt,
    plus,
    seq,
    star,
)
from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask
from agent_infer.grammar.runtime.matcher import GrammarMatcher

TOKENIZERS = ["deepseek", "smollm2"]


def parens_viable(text: str) -> bool:
    depth = 0
    for ch in text:
        if ch not in "()":
            return False
        depth += 1 if ch == "(" else -1
        if depth < 0:
            return False
    return True


def regex_viable(pattern: str) -> Callable[[str], bool]:
    compiled = regex.compile(pattern)
    return lambda text: compiled.fullmatch(text, partial=True) is not None


# name -> (grammar, viable-prefix oracle, accepted strings, rejected strings, alphabet for fuzzing)
CASES: dict[str, tuple[Grammar, Callable[[str], bool], list[str], list[str], str]] = {
    "literals": (
        Grammar.from_expr(alt(lit("cat"), lit("car"), lit("dog"), lit("ünïcödé ✓"))),
        regex_viable("(?:cat|car|dog|ünïcödé ✓)"),
        ["cat", "car", "dog", "ünïcödé ✓"],
        ["ca", "cats", "dot", "ünïcöde ✓", ""],
        "catrdogünïé ✓",
    ),
    "unicode_class": (
        Grammar.from_expr(
            plus(
                CharClass(((0x61, 0x7A), (0xE0, 0xFF), (0x3B1, 0x3C9), (0x4E00, 0x9FFF), (0x1F600, 0x1F64F)))
            )
        ),
        regex_viable("[a-zà-ÿα-ω\u4e00-\u9fff\U0001f600-\U0001f64f]+"),
        ["héllo", "αβγ", "日本語", "😀😎ab", "ÿ"],
        ["", "Hello", "a b", "ß€", "😀🚀"],
        "azàÿαω日本😀😎🚀AB €",
    ),
    "repeats": (
        Grammar.from_expr(
            seq(Repeat(chars("ab"), 2, 4), lit("-"), star(chars("0-9")), Repeat(lit("xy"), 3, 3))
        ),
        regex_viable("[ab]{2,4}-[0-9]*(?:xy){3}"),
        ["ab-xyxyxy", "abba-0123xyxyxy", "bb-9xyxyxy"],
        ["a-xyxyxy", "ababa-xyxyxy", "ab-xyxy", "ab-xyxyxyxy", "ab-1x"],
        "ab-019xy",
    ),
    "negated_class": (
        Grammar.from_expr(
            seq(lit('"'), star(CharClass(((0x22, 0x22), (0x0A, 0x0A)), negated=True)), lit('"'))
        ),
        regex_viable('"[^"\n]*"'),
        ['""', '"héllo wörld ✓ 日本"', '"a\\b"'],
        ['"', '"a"b', '"a\nb"', "x"],
        'a"é\n\\ ✓',
    ),
    "parens": (
        Grammar.from_rules({"root": star(Ref("p")), "p": seq(lit("("), star(Ref("p")), lit(")"))}),
        parens_viable,
        ["", "()", "(())()", "((()())())"],
        [")", "(()))", "(a)"],
        "()",
    ),
    "left_recursion": (
        Grammar.from_rules(
            {
                "root": Ref("expr"),
                "expr": alt(seq(Ref("expr"), lit("+"), Ref("term")), Ref("term")),
                "term": plus(chars("0-9")),
            }
        ),
        regex_viable("[0-9]+(?:\\+[0-9]+)*"),
        ["1", "12+3", "1+2+345+6"],
        ["", "+1", "1++2", "1+"],
        "0129+",
    ),
    "right_recursion": (
        Grammar.from_rules(
            {
                "root": seq(lit('"'), Ref("key"), lit('"'), opt(seq(lit(","), Ref("root")))),
                "key": alt(seq(CharClass(((0x22, 0x22), (0x5C, 0x5C)), negated=True), Ref("key")), lit("")),
            }
        ),
        regex_viable('"[^"\\\\]*"(?:,"[^"\\\\]*")*'),
        ['""', '"abc"', '"日本 x","y"', '"a","b",""'],
        ['"', '"a"b', '"a",', "a"],
        'ab",\\ 日',
    ),
    "nullable_rules": (
        Grammar.from_rules(
            {
                "root": seq(Ref("a"), Ref("b"), Ref("a"), lit("!")),
                "a": alt(lit("x"), Repeat(chars("yz"), 0, 2)),
                "b": alt(Ref("a"), seq(lit("["), Ref("b"), lit("]"))),
            }
        ),
        # b is a bracket nest around an `a`; check the regular approximation only on depth <= 2.
        regex_viable(
            r"(?:x|[yz]{0,2})(?:(?:x|[yz]{0,2})|\[(?:(?:x|[yz]{0,2})|\[(?:x|[yz]{0,2})\])\])(?:x|[yz]{0,2})!"
        ),
        ["!", "x!", "xyzx!", "[]!", "y[[z]]x!", "[[x]]!"],
        ["", "xxxx!", "[x!", "x]!"],
        "xyz[]!",
    ),
}


@pytest.fixture(scope="module")
def byte_compiler() -> GrammarCompiler:
    return GrammarCompiler(TokenizerInfo.bytes_only())


def _bits(bitmask: object, vocab: int) -> np.ndarray:
    words = bitmask[0].numpy().view(np.uint8)  # type: ignore[index]
    return np.unpackbits(words, bitorder="little")[:vocab].astype(bool)


@pytest.mark.parametrize("case", sorted(CASES))
def test_accept_string(case: str, byte_compiler: GrammarCompiler) -> None:
    grammar, viable, good, bad, alphabet = CASES[case]
    compiled = byte_compiler.compile(grammar)
    for text in good:
        m = GrammarMatcher(compiled)
        assert m.accept_string(text), text
        assert m.can_terminate(), text
    for text in bad:
        m = GrammarMatcher(compiled)
        assert not (m.accept_string(text) and m.can_terminate()), text
    # Fuzz against the oracle: viability of every random string and of every prefix of good ones.
    rng = random.Random(case)
    samples = [g[:k] for g in good for k in range(len(g) + 1)]
    samples += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))) for _ in range(300)]
    if case == "nullable_rules":
        samples = [s for s in samples if s.count("[") <= 2]
    for text in samples:
        m = GrammarMatcher(compiled)
        assert m.accept_string(text) == viable(text), text


@pytest.mark.parametrize("case", sorted(CASES))
def test_bytes_mask_matches_oracle(case: str, byte_compiler: GrammarCompiler) -> None:
    """With the byte vocabulary, bit b is set iff prefix+b is viable (partial UTF-8 handled by decoding)."""
    grammar, viable, good, _, _ = CASES[case]
    compiled = byte_compiler.compile(grammar)
    info = byte_compiler.tokenizer_info
    bitmask = allocate_token_bitmask(1, info.vocab_size)
    for text in good:
        data = text.encode()
        m = GrammarMatcher(compiled)
        for k in range(len(data) + 1):
            m.fill_next_token_bitmask(bitmask)
            bits = _bits(bitmask, info.vocab_size)
            for b in range(256):
                fork = m.fork()
                assert bits[b] == fork.accept_token(b), (text, k, b)
                candidate = data[:k] + bytes([b])
                try:
                    decoded = candidate.decode()
                except UnicodeDecodeError:
                    continue  # an incomplete character: the matcher's own answer was checked above
                if case == "nullable_rules" and decoded.count("[") > 2:
                    continue  # beyond the oracle's bracket depth
                assert bits[b] == viable(decoded), (text, k, b)
            assert bits[256] == m.can_terminate()
            if k < len(data):
                assert m.accept_token(data[k])


def _token_mask_exact(
    compiled: object, info: TokenizerInfo, ids: list[int], viable: Callable[[str], bool]
) -> None:
    m = GrammarMatcher(compiled)  # type: ignore[arg-type]
    bitmask = allocate_token_bitmask(1, info.vocab_size)
    vocab = info.decoded_vocab
    prefix = b""
    checkpoints = sorted({0, len(ids), len(ids) // 2, max(0, len(ids) - 1)})
    pos = 0
    for cp in checkpoints:
        while pos < cp:
            assert m.accept_token(ids[pos])
            prefix += info.token_bytes(ids[pos])
            pos += 1
        m.fill_next_token_bitmask(bitmask)
        bits = _bits(bitmask, info.vocab_size)
        for tid in range(info.vocab_size):
            expected = m.fork().accept_token(tid)
            assert bits[tid] == expected, (prefix, tid, info.token_bytes(tid))
            piece = vocab[tid] if tid < len(vocab) else b""
            if piece and tid not in info.eos_token_ids:
                try:
                    text = (prefix + piece).decode()
                except UnicodeDecodeError:
                    continue
                assert expected == viable(text), (prefix, piece)


@pytest.mark.parametrize("tok_name", TOKENIZERS)
@pytest.mark.parametrize(
    "case",
    ["literals", "unicode_class", "repeats", "parens", "left_recursion", "nullable_rules", "right_recursion"],
)
def test_token_mask_exact(tok_name: str, case: str) -> None:
    info = tokenizer_info(tok_name)
    compiler = GrammarCompiler(info)
    grammar, viable, good, _, _ = CASES[case]
    compiled = compiler.compile(grammar)
    text = max(good, key=len)
    ids = hf_tokenizer(tok_name).encode(text, add_special_tokens=False).ids
    _token_mask_exact(compiled, info, ids, viable)


@pytest.mark.parametrize("tok_name", TOKENIZERS)
def test_multibyte_split_across_tokens(tok_name: str) -> None:
    """A character split over two tokens is accepted piecewise; invalid UTF-8 never is."""
    info = tokenizer_info(tok_name)
    compiled = GrammarCompiler(info).compile(Grammar.from_expr(plus(CharClass(((0x4E00, 0x9FFF),)))))
    vocab = info.decoded_vocab
    partial = [i for i, b in enumerate(vocab) if len(b) == 1 and 0xE4 <= b[0] <= 0xE9]
    assert partial, "tokenizer lacks single-lead-byte tokens"
    m = GrammarMatcher(compiled)
    bitmask = allocate_token_bitmask(1, info.vocab_size)
    m.fill_next_token_bitmask(bitmask)
    bits = _bits(bitmask, info.vocab_size)
    assert all(bits[i] for i in partial)
    for tid, piece in enumerate(vocab):
        if bits[tid]:
            assert piece and 0xE4 <= piece[0] <= 0xE9, piece
    assert m.accept_token(partial[0])
    assert not m.can_terminate()


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
    compiled = byte_compiler.compile(CASES["left_recursion"][0])
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
    compiled = byte_compiler.compile(CASES["left_recursion"][0])
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


def _random_expr(rng: random.Random, rules: list[str], depth: int) -> Expr:
    kind = rng.randrange(7 if depth < 3 else 3)
    if kind == 0:
        return lit("".join(rng.choice("ab()") for _ in range(rng.randint(1, 3))))
    if kind == 1:
        return chars(rng.choice(["a", "ab", "()", "a-b", "("]))
    if kind == 2:
        return Ref(rng.choice(rules))
    if kind == 3:
        return seq(*(_random_expr(rng, rules, depth + 1) for _ in range(rng.randint(2, 3))))
    if kind == 4:
        return alt(*(_random_expr(rng, rules, depth + 1) for _ in range(rng.randint(2, 3))))
    if kind == 5:
        lo = rng.randint(0, 2)
        return Repeat(_random_expr(rng, rules, depth + 1), lo, rng.choice([None, lo, lo + 2]))
    return Empty()


def test_random_grammars_mask_exact() -> None:
    """Random recursive grammars over a multi-byte toy vocabulary: mask == accept_token on forks.

    Short tokens over a tiny alphabet hit every classification path: rules finishing and calling
    other rules mid-token, nullable rules, left recursion and ambiguity.
    """
    alphabet = "ab()"
    tails = ["", *alphabet]
    vocab = sorted({a + b + c for a in alphabet for b in tails for c in tails}, key=lambda v: (len(v), v))
    info = TokenizerInfo([v.encode() for v in vocab] + [b""], eos_token_ids=[len(vocab)])
    compiler = GrammarCompiler(info, cache_enabled=False)
    rng = random.Random(1234)
    bitmask = allocate_token_bitmask(1, info.vocab_size)
    checked = 0
    for _ in range(150):
        names = ["root", "r1", "r2", "r3"]
        grammar = Grammar.from_rules({name: _random_expr(rng, names, 0) for name in names})
        try:
            compiled = compiler.compile(grammar)
        except GrammarDefinitionError:
            continue  # empty language
        m = GrammarMatcher(compiled)
        for _step in range(8):
            m.fill_next_token_bitmask(bitmask)
            bits = _bits(bitmask, info.vocab_size)
            allowed = []
            for tid in range(info.vocab_size):
                ok = m.fork().accept_token(tid)
                assert bits[tid] == ok, (str(grammar), tid)
                if ok:
                    allowed.append(tid)
            checked += 1
            if not allowed:
                break
            assert m.accept_token(rng.choice(allowed))
            if m.is_terminated():
                break
    assert checked > 200
