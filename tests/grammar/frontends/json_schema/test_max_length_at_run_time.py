"""``maxLength`` counted at run time: a string whose pattern or format automaton times the length
bound is over the product's state limit compiles to a BoundedString rule, and the matcher counts
the decoded code points of the open string.

* Such schemas compile (to a ``%max-length`` rule) and agree with jsonschema around the bound,
  with escapes, non-ASCII characters and surrogate pairs counted as one code point each.
* Masks are exact near the bound (each token's bit equals accept-and-rollback) over the bytes-only
  vocabulary at every position and over DeepSeek-V4's, where one token may hold many characters,
  close the string and open the next; several counted strings open at once, small bounds a token
  can overrun by itself, and a bound no string fits are covered at the grammar level.
* The reference recognizer agrees; forced bytes and the shortest completion respect the count;
  a bounded rule that calls another rule, or is the root, is refused.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import numpy as np
import pytest

from agent_infer.errors import GrammarDefinitionError
from agent_infer.grammar import CompiledGrammar, Grammar, GrammarCompiler, GrammarMatcher, TokenizerInfo
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer

WORDS = {"type": "string", "pattern": "^(?:\\S+\\s+){0,29}\\S+$", "maxLength": 300}
EMAIL = {"type": "string", "format": "email", "maxLength": 190}
COUNTED: list[Any] = [
    WORDS,
    EMAIL,
    {"type": "string", "format": "hostname", "maxLength": 128},
    {"type": "string", "format": "uri-reference", "maxLength": 2000},
    {"type": "string", "pattern": "^[a-z]{1,32}(\\.[a-z]{1,32}){1,3}$", "maxLength": 100, "minLength": 3},
]


@pytest.fixture(scope="module")
def byte_compiler() -> GrammarCompiler:
    return GrammarCompiler(TokenizerInfo.bytes_only(), cache_enabled=False)


def _accepts(compiled: CompiledGrammar, text: str) -> bool:
    m = GrammarMatcher(compiled)
    return m.accept_string(text) and m.can_terminate()


def _mask_ids(m: GrammarMatcher, vocab: int) -> np.ndarray:
    from grammar_support import mask_bits

    return mask_bits(m, vocab)[:vocab]


@pytest.mark.parametrize("schema", COUNTED, ids=lambda s: s.get("format") or s.get("pattern"))
def test_products_over_the_limit_are_counted_at_run_time(schema: Any) -> None:
    g = Grammar.from_json_schema(schema)
    assert f"%max-length({schema['maxLength']} " in str(g)


def _words(n_chars: int, extra: str) -> str:
    """26 words of the WORDS pattern (blanks a tab or a newline, a non-ASCII character and a
    surrogate pair among them), ``n_chars`` code points in all, ending with ``extra``."""
    head = "".join("abcdéfghi\t" if i % 2 else "jk😀lmnopq\n" for i in range(25))
    return head + "x" * (n_chars - len(head) - len(extra)) + extra


WORD_VALUES = [
    _words(n, extra)
    for n in (299, 300, 301)
    for extra in ("z", "😀", "\u00e9\u00e9", '"q"', "\\")
    if len(extra) < n
]


@pytest.mark.parametrize("ascii_only", [True, False])
def test_agrees_with_jsonschema_around_the_bound(ascii_only: bool, byte_compiler: GrammarCompiler) -> None:
    compiled = byte_compiler.compile(Grammar.from_json_schema(WORDS))
    validator = jsonschema.Draft202012Validator(WORDS)
    seen = set()
    for value in WORD_VALUES:
        seen.add(validator.is_valid(value))
        text = json.dumps(value, ensure_ascii=ascii_only)
        assert _accepts(compiled, text) == validator.is_valid(value), (len(value), text[-20:])
    assert seen == {True, False}


def test_emails_at_the_bound(byte_compiler: GrammarCompiler) -> None:
    compiled = byte_compiler.compile(Grammar.from_json_schema(EMAIL))
    for n in (189, 190, 191):
        value = "a" * (n - len("@example.com")) + "@example.com"
        assert _accepts(compiled, json.dumps(value)) == (n <= 190), n


def _bytes_only_exact(compiled: CompiledGrammar, text: str, start: int) -> None:
    """From byte ``start`` of ``text`` on: the mask equals accept-and-rollback, and every allowed
    byte but EOS can still be completed to a document."""
    from grammar_support import assert_bits_match_acceptance

    info = compiled.tokenizer_info
    m = GrammarMatcher(compiled)
    data = text.encode()
    assert m.accept_string(data[:start])
    for pos in range(start, len(data)):
        bits = _mask_ids(m, info.vocab_size)
        assert_bits_match_acceptance(m, bits, pos)
        for tid in np.flatnonzero(bits):
            if int(tid) in info.eos_token_ids:
                continue
            assert m.accept_token(int(tid))
            assert m.shortest_completion() is not None, (pos, info.token_bytes(int(tid)))
            m.rollback(1)
        assert m.accept_string(data[pos : pos + 1]), pos
    assert m.can_terminate()


def test_masks_exact_and_completable_bytes_only(byte_compiler: GrammarCompiler) -> None:
    words = byte_compiler.compile(Grammar.from_json_schema(WORDS))
    text = json.dumps(_words(300, "😀"))
    _bytes_only_exact(words, text, len(text) - 40)
    email = byte_compiler.compile(Grammar.from_json_schema(EMAIL))
    text = json.dumps("b" * 170 + "@example.org")
    _bytes_only_exact(email, text, len(text) - 30)


@pytest.mark.parametrize(
    ("schema", "value"),
    [
        (WORDS, _words(300, "end")),
        (EMAIL, "first.last" * 17 + "@example.org"),
        ({"type": "array", "items": EMAIL}, ["a@b.co", "c" * 170 + "@example.org", "x@y.io"]),
    ],
    ids=["words", "email", "emails"],
)
def test_masks_exact_on_a_real_vocabulary(schema: Any, value: Any) -> None:
    """DeepSeek-V4 tokens hold many characters: near the bound, every id against accept + rollback
    (the positions before it are checked every 16th)."""
    from grammar_support import assert_mask_exact, tokenizer_info

    compiled = GrammarCompiler(tokenizer_info("deepseek"), cache_enabled=False).compile(
        Grammar.from_json_schema(schema)
    )
    text = json.dumps(value, separators=(",", ":"))
    m = GrammarMatcher(compiled)
    for pos in range(len(text)):
        if pos % 16 == 0 or pos >= len(text) - 24:
            assert_mask_exact(m, pos)
        assert m.accept_string(text[pos]), pos
    assert m.can_terminate()


# Grammar-level cases: several counted strings open at once (an unbounded one beside them),
# bounds a DeepSeek token overruns by itself, a bound no string fits.
GRAMMARS: dict[str, tuple[str, list[str], list[str]]] = {
    "several": (
        r"""
root ::= "[" v ("," v)* "]"
v ::= a | b | c
a ::= %max-length(3 "\"" [a-z]* "\"")
b ::= %max-length(6 "\"" [a-m]* "x" [a-z]* "\"")
c ::= "\"" [0-9]+ "\""
""",
        ['["abc","abcx","123","aaaaax","ab","12345678901"]'],
        ['["abcdefgx"]', '["abcdefgh"]'],
    ),
    "small": (
        r"""
root ::= "{" "\"k\":" s ("," "\"k\":" s)* "}"
s ::= %max-length(1 "\"" [a-z ]* "\"")
""",
        ['{"k":"a","k":"","k":" "}'],
        ['{"k":"ab"}'],
    ),
    "none-fits": (
        r"""
root ::= "[" (s | "1") "]"
s ::= %max-length(2 "\"" "abc" [a-z]* "\"")
""",
        ["[1]"],
        ['["abc"]'],
    ),
    "escapes": (
        r"""
root ::= "[" s "]"
s ::= %max-length(2 "\"" ([a-z] | "\\n" | "\\u" [0-9a-fA-F]{4} | [^\x00-\x7f])* "\"")
""",
        ['["\\ud83d\\ude00a"]', '["\\n\\u00e9"]', '["😀a"]', '["\\ud83d\\ud83d"]'],
        ['["\\ud83d\\ud83d\\ude00a"]', '["\\ud83dab"]', '["abc"]'],
    ),
}


@pytest.mark.parametrize("name", list(GRAMMARS))
def test_grammar_level_masks_exact_on_a_real_vocabulary(name: str) -> None:
    from grammar_support import assert_mask_exact, tokenizer_info

    src, good, bad = GRAMMARS[name]
    g = Grammar.from_ebnf(src)
    compiled = GrammarCompiler(tokenizer_info("deepseek"), cache_enabled=False).compile(g)
    rec = ReferenceRecognizer(g)
    for text in good:
        m = GrammarMatcher(compiled)
        for pos in range(len(text)):
            assert_mask_exact(m, pos)
            assert m.accept_string(text[pos]), (text, pos)
        assert m.can_terminate() and rec.accepts(text)
    for text in bad:
        assert not _accepts(compiled, text) and not rec.accepts(text), text


def test_the_reference_recognizer_agrees(byte_compiler: GrammarCompiler) -> None:
    g = Grammar.from_json_schema(WORDS)
    rec = ReferenceRecognizer(g)
    compiled = byte_compiler.compile(g)
    for value in WORD_VALUES[::3]:
        text = json.dumps(value)
        assert rec.accepts(text) == _accepts(compiled, text), len(value)


def test_forced_bytes_and_the_shortest_completion_respect_the_count(byte_compiler: GrammarCompiler) -> None:
    compiled = byte_compiler.compile(
        Grammar.from_ebnf('root ::= "[" s "]"\ns ::= %max-length(3 "\\"" ("a"* | "é"+ | "bc") "\\"")\n')
    )
    m = GrammarMatcher(compiled)
    assert m.accept_string('["éé')
    assert m.find_forced_bytes() == (b"", False)
    assert m.accept_string("é")
    assert m.find_forced_bytes() == (b'"]', True)
    assert m.shortest_completion() == b'"]'
    fork = m.fork()
    m.rollback(1)
    assert m.accept_string("é") and not m.accept_string("é")
    assert not fork.accept_string("é") and fork.accept_string('"]')


@pytest.mark.parametrize(
    ("src", "match"),
    [
        (
            'root ::= "[" s "]"\ns ::= %max-length(3 "\\"" w "\\"")\nw ::= [a-z] w | ""\n',
            "calls another rule",
        ),
        ('root ::= %max-length(3 "\\"" [a-z]* "\\"")\n', "root rule"),
    ],
)
def test_refused_where_the_count_cannot_be_kept(src: str, match: str, byte_compiler: GrammarCompiler) -> None:
    with pytest.raises(GrammarDefinitionError, match=match):
        byte_compiler.compile(Grammar.from_ebnf(src))
