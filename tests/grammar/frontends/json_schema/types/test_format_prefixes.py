"""format + a literal-prefix pattern: the format's derivative equals the automaton product."""

from __future__ import annotations

import json
import random
import re

import pytest

from agent_infer.grammar import Grammar
from agent_infer.grammar.frontends.json_schema.types.format_prefixes import literal_prefixes, prefixed_format
from agent_infer.grammar.frontends.regex.search import regex_search_expr
from agent_infer.grammar.ir import Alt, CharClass, Literal, Repeat, Seq
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer

URIS = [
    "https:",
    "https://example.com",
    "https://example.com/a?b=c#d",
    "https://user@host:8080/p%20q",
    "https://[::1]/x",
    "https://exa mple.com",
    "https:/relative",
    "http://example.com",
    "HTTPS://example.com",
    "https",
    "",
    "mailto:x@y",
    "https://%zz",
    "https://ex\u00e9.com",
    'https://a"b',
]


def _rec(schema: dict[str, object]) -> ReferenceRecognizer:
    return ReferenceRecognizer(Grammar.from_json_schema(schema, whitespace="compact"))


@pytest.mark.parametrize(
    ("fmt", "prefix"), [("uri", "https:"), ("uri", "https://"), ("date", "2024-0"), ("email", "a@")]
)
def test_prefixed_format_matches_product(fmt: str, prefix: str) -> None:
    fast = {"type": "string", "format": fmt, "pattern": "^" + re.escape(prefix).replace("\\:", ":")}
    # [\s\S]*[\s\S]*$ after the prefix is the same language but not a bare literal prefix (an
    # unanchored tail would be absorbed into the search's own padding): automaton product.
    slow = {
        "type": "string",
        "format": fmt,
        "pattern": "^" + re.escape(prefix).replace("\\:", ":") + r"[\s\S]*[\s\S]*$",
    }
    g_fast = Grammar.from_json_schema(fast, whitespace="compact")
    assert not any(re.search(r"(^|-)str(-\d+)?$", name) for name, _ in g_fast.rules), str(g_fast)
    assert any(re.search(r"(^|-)str(-\d+)?$", name) for name, _ in Grammar.from_json_schema(slow).rules)
    rf, rs = ReferenceRecognizer(g_fast), _rec(slow)
    rng = random.Random(fmt + prefix)
    words = [*URIS, "2024-01-31", "2024-02-30", "2024-0", "2023-01-01", "a@b.c", "a@b", "b@c.d", "a@"]
    words += [
        prefix + "".join(rng.choice("az09:/@.-%[]?#") for _ in range(rng.randint(0, 12))) for _ in range(300)
    ]
    agree = 0
    for w in words:
        text = json.dumps(w)
        assert rf.accepts(text) is rs.accepts(text), w
        agree += rf.accepts(text)
    assert agree > 0  # some words are in the language, so the comparison is not vacuous


def test_literal_prefix_shapes() -> None:
    assert literal_prefixes(regex_search_expr("^https:", dialect="ecma")) == ["https:"]
    assert literal_prefixes(regex_search_expr("https:", dialect="ecma")) is None
    assert literal_prefixes(regex_search_expr("^https:$", dialect="ecma")) is None


def test_literal_prefixes_spell_a_small_head() -> None:
    def leads(pattern: str) -> list[str] | None:
        return literal_prefixes(regex_search_expr(pattern, dialect="ecma"))

    assert leads("^https?://") == ["http://", "https://"]
    assert leads("^a[bc]") == ["ab", "ac"]
    assert leads("^(ftp|https?):") == ["ftp:", "http:", "https:"]
    assert leads("^x{1,3}-") == ["x-", "xx-", "xxx-"]
    assert leads("^[a-z]:") is None  # 26 spellings: past the limit
    assert leads("^https?://$") is None  # anchored at the end: not "anything after"
    assert leads("^(a|)") is None  # an optional head accepts every string
    assert leads("^a+b") is None


@pytest.mark.parametrize("pattern", ["^https?://", "^(ftp|https?):", "^x{1,2}"])
def test_several_leads_match_the_product(pattern: str) -> None:
    fast = {"type": "string", "format": "uri", "pattern": pattern}
    slow = {"type": "string", "format": "uri", "pattern": pattern + r"[\s\S]*[\s\S]*$"}
    g_fast = Grammar.from_json_schema(fast, whitespace="compact")
    assert not any(re.search(r"(^|-)str(-\d+)?$", name) for name, _ in g_fast.rules), str(g_fast)
    rf, rs = ReferenceRecognizer(g_fast), _rec(slow)
    rng = random.Random(pattern)
    words = [*URIS, "ftp:", "ftp://x", "http:x", "x:", "xx:y", "xxx:y", "x"]
    words += [
        rng.choice(["http://", "https://", "ftp:", "x", "xx", "htt", ""])
        + "".join(rng.choice("az09:/@.-%[]?#") for _ in range(rng.randint(0, 12)))
        for _ in range(300)
    ]
    agree = 0
    for w in words:
        text = json.dumps(w)
        assert rf.accepts(text) is rs.accepts(text), w
        agree += rf.accepts(text)
    assert agree > 0


def test_derivative_by_prefix() -> None:
    cls = CharClass(((97, 122),))
    # (ab|a[a-z]*)x{2,3} by "ab": b-continuations of both branches.
    expr = Seq((Alt((Literal("ab"), Seq((Literal("a"), Repeat(cls, 0, None))))), Repeat(Literal("x"), 2, 3)))
    got = prefixed_format(expr, "ab")
    assert got is not None
    rec = ReferenceRecognizer(Grammar.from_expr(got))
    want = re.compile(r"(ab|a[a-z]*)x{2,3}")
    for w in ["ab", "abxx", "abxxx", "abxxxx", "abzxx", "abz", "ax", "abbbxx", "b", "abxxy"]:
        assert rec.accepts(w) is (w.startswith("ab") and want.fullmatch(w) is not None), w
    assert prefixed_format(Literal("abc"), "x") == Alt(())
