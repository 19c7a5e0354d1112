"""Native lowering: shared continuations are outlined, and long chains of equal rules merge.

``grammar/lower/outline.cpp`` rewrites ``Seq(Alt(a, Ref x), Ref y)`` (x a big inlined rule such as
JSON's escapes, y a separate rule) into ``Alt(Seq(a, Ref y), Ref z)`` with one shared
``z ::= x y``, so the nodes of a "key except these names" trie stop carrying a copy of x's
automaton each. ``grammar/lower/dedupe.cpp`` re-checks only the rules whose callees changed class, so
two copies of a 1 500-rule chain (a ``pattern`` with a ``maxLength``, written as rules) merge
instead of exhausting its work budget. These tests pin both by state counts and check that the
language and the token masks stay exact.
"""

from __future__ import annotations

import json

from grammar_support import assert_mask_exact, hf_tokenizer, tokenizer_info

from agent_infer.grammar.compile.compiler import CompiledGrammar, GrammarCompiler
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.ir import Expr, Grammar, Ref, alt, chars, lit, seq
from agent_infer.grammar.runtime.matcher import GrammarMatcher

# Finite and small: inlined into its callers. Big enough (its program) to be worth sharing.
ESC = alt(
    *(lit("\\" + c) for c in '"\\/bfnrt'),
    seq(lit("\\u"), chars("0-9a-fA-F"), chars("0-9a-fA-F"), chars("0-9a-fA-F"), chars("0-9a-fA-F")),
)


def _char() -> Expr:
    return alt(chars("a-z"), Ref("esc"))


def _trie(nodes: int) -> Grammar:
    """A chain of trie nodes: node i takes its digit to node i+1 or any other key character to
    the free rest (a recursive rule, so never inlined), as the JSON Schema key tries do."""
    rules: dict[str, Expr] = {
        "root": Ref("node0"),
        "esc": ESC,
        "rest": alt(seq(_char(), Ref("rest")), lit("")),
    }
    for i in range(nodes):
        nxt = Ref(f"node{i + 1}") if i + 1 < nodes else lit("")
        rules[f"node{i}"] = alt(seq(_char(), Ref("rest")), seq(lit(str(i % 10)), nxt), lit(""))
    return Grammar.from_rules(rules)


def _compile(grammar: Grammar, info: TokenizerInfo | None = None) -> CompiledGrammar:
    return GrammarCompiler(info or TokenizerInfo.bytes_only(), cache_enabled=False).compile(grammar)


def _accepts(compiled: CompiledGrammar, text: str) -> bool:
    m = GrammarMatcher(compiled)
    return m.accept_string(text) and m.can_terminate()


def test_trie_nodes_share_one_copy_of_the_escapes() -> None:
    esc_states = _compile(Grammar.from_rules({"root": Ref("esc"), "esc": ESC})).num_states
    small, large = _compile(_trie(10)), _compile(_trie(30))
    per_node = (large.num_states - small.num_states) / 20
    # A node is 4 states of its own; a copy of the escapes (7 states) in each would make it 9.
    assert esc_states >= 6
    assert per_node < esc_states - 1, (per_node, esc_states)
    for text in ["", "0", "01", "0x", "0\\n", "01\\u00e9zz", "0\\\\a\\/", "0123456789012"]:
        assert _accepts(large, text), text
    for text in ["0\\", "0\\u12", "0\\x", "x1\\", "0A", "01\\uZZZZ"]:
        assert not _accepts(large, text), text


def test_free_keys_masks_exact() -> None:
    """A schema with free keys (its key trie is outlined): every token's bit at every position of
    a document whose keys use escapes and non-ASCII equals accept_token on a fork."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "nav": {"type": "integer"}}}
    doc = {"name": "v", "nav": 2, 'na\u00e9\n"x': 1, "n\\a": [True], "nam": "\u65e5"}
    info = tokenizer_info("smollm2")
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(schema, whitespace="compact")
    )
    tok = hf_tokenizer("smollm2")
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
    ids = [t for ch in text for t in tok.encode(ch, add_special_tokens=False).ids]
    m = GrammarMatcher(compiled)
    for pos, tid in enumerate(ids):
        if pos < 24 or pos % 3 == 0:
            assert_mask_exact(m, pos)
        assert m.accept_token(tid), pos
    assert m.can_terminate()


def _chain(prefix: str, n: int) -> dict[str, Expr]:
    rules: dict[str, Expr] = {}
    for i in range(n):
        rules[f"{prefix}{i}"] = (
            alt(seq(chars("a-z"), Ref(f"{prefix}{i + 1}")), lit("")) if i + 1 < n else lit("")
        )
    return rules


def test_two_long_chains_merge() -> None:
    n = 1500
    two = Grammar.from_rules(
        {"root": seq(Ref("a0"), lit("|"), Ref("b0")), **_chain("a", n), **_chain("b", n)}
    )
    one = Grammar.from_rules({"root": seq(Ref("a0"), lit("|"), Ref("a0")), **_chain("a", n)})
    c2, c1 = _compile(two), _compile(one)
    assert c2.num_states == c1.num_states
    assert _accepts(c2, "x" * (n - 1) + "|" + "ab")
    assert _accepts(c2, "|")
    assert not _accepts(c2, "x" * n + "|")
    assert not _accepts(c2, "ab|" + "y" * n)
