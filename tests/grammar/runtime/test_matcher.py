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

from agent_infer.errors import GrammarDefinitionError
from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.ir import (
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
