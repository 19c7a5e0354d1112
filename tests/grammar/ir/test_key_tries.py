"""The key-trie node kinds (``KeySet``, ``KeyNode``): declared IR nodes that print as what the
compiler takes, compare by their source, expand (through the JSON Schema front end's registered
expansion) to the alternation they stand for, and are handled by every IR reader."""

from __future__ import annotations

import json

import pytest

from agent_infer.errors import GrammarDefinitionError, GrammarSyntaxError
from agent_infer.grammar import GrammarCompiler, GrammarMatcher, TokenizerInfo, clear_grammar_caches
from agent_infer.grammar.frontends.ebnf.gbnf import parse_gbnf
from agent_infer.grammar.ir import NODE_KINDS, Alt, Grammar, KeyNode, KeySet, Ref
from agent_infer.grammar.ir.nodes import _EXPANSIONS
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer
from agent_infer.testing import random_strings


def _keys_grammar(names: list[str]) -> Grammar:
    clear_grammar_caches()
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names}}
    return Grammar.from_json_schema(schema, whitespace="compact")


def test_both_kinds_are_declared_node_kinds() -> None:
    assert NODE_KINDS[7:9] == (KeyNode, KeySet)
    assert KeySet.FREE_RULE == "char-key-free" and KeySet.REST_RULE == KeyNode.REST_RULE == "char-key-rest"
    assert set(_EXPANSIONS) == {KeySet, KeyNode}  # registered by the JSON Schema front end


def test_a_key_set_prints_as_the_set_it_compiles_to() -> None:
    g = _keys_grammar(["apiVersion", "kind", "a b"])
    (name,) = [n for n, body in g.rules if isinstance(body, KeySet)]
    assert f'{name} ::= %key-set("a b" "apiVersion" "kind")\n' in str(g)
    assert "%key-node" not in str(g)


def test_a_key_node_prints_its_edges_and_whether_it_ends_a_name() -> None:
    node = KeyNode((True, ord("a"), "char-key-n1", ord("é"), "char-key-n2"))
    g = Grammar.unchecked((("root", node),), "root")
    assert str(g) == 'root ::= %key-node(ends-name "a"->char-key-n1 "é"->char-key-n2)\n'
    assert str(Grammar.unchecked((("root", KeyNode((False, 0x2F, "x"))),), "root")) == (
        'root ::= %key-node("/"->x)\n'
    )
    g = _keys_grammar(["a/b", "ab"])
    nodes = [body for _, body in g.rules if isinstance(body, KeyNode)]
    assert nodes and all("%key-node(" in str(g) for _ in nodes)


def test_nodes_compare_by_source_not_by_expansion() -> None:
    k = KeySet(("a", "bc"))
    assert k == KeySet(("a", "bc")) and hash(k) == hash(KeySet(("a", "bc")))
    assert k != KeySet(("a",)) and k != Alt(k.expand())
    with pytest.raises(AttributeError):
        k._names = ("z",)  # type: ignore[misc]
    assert k.children() == k.expand() and k.expand() is k.expand()


def test_an_unregistered_kind_says_what_to_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(_EXPANSIONS, KeySet)
    with pytest.raises(GrammarDefinitionError, match="no expansion registered for KeySet"):
        KeySet(("q",)).expand()


def test_readers_of_the_ir_agree_with_the_compiled_grammar() -> None:
    """The reference recognizer and the string sampler read the expansion; the compiler the set."""
    g = _keys_grammar(["apiVersion", "kind", "a/b", "é"])
    assert any(isinstance(b, KeySet) for _, b in g.rules) or any(isinstance(b, KeyNode) for _, b in g.rules)
    rec = ReferenceRecognizer(g)
    matcher_compiler = GrammarCompiler(TokenizerInfo.bytes_only(), cache_enabled=False)
    compiled = matcher_compiler.compile(g)
    for doc in ['{"kind":1}', '{"kin":1}', '{"kind":1,"a\\/b":2}', '{"\\u00e9":1}', '{"x":"y"}', "{}"]:
        m = GrammarMatcher(compiled)
        assert rec.accepts(doc) == (m.accept_string(doc) and m.can_terminate()), doc
    for text in random_strings(g, 20, seed=3):
        assert rec.accepts(text), text
        json.loads(text)


def test_a_union_renames_key_tries_through_their_expansion() -> None:
    g = _keys_grammar(["apiVersion", "kind"])
    both = Grammar.union(g, Grammar.from_regex("x"))
    assert not any(isinstance(b, KeySet | KeyNode) for _, b in both.rules)
    refs = {n.name for _, b in both.rules if isinstance(b, Alt) for n in b.items if isinstance(n, Ref)}
    assert "g0-char-key-free" in refs
    compiled = GrammarCompiler(TokenizerInfo.bytes_only(), cache_enabled=False).compile(both)
    for doc, ok in [('{"kind":1,"other":2}', True), ('{"kind":"s"}', False), ("x", True)]:
        m = GrammarMatcher(compiled)
        assert (m.accept_string(doc) and m.can_terminate()) == ok, doc


@pytest.mark.parametrize(
    "names",
    [["apiVersion", "kind", "a b"], ["a/b", "é", "ab", '"q"', "back\\slash", "\x01"]],
    ids=["key-set", "key-nodes"],
)
def test_printed_key_tries_read_back_to_an_equal_grammar(names: list[str]) -> None:
    g = _keys_grammar(names)
    assert any(isinstance(b, KeySet | KeyNode) for _, b in g.rules)
    again = parse_gbnf(str(g))
    assert again == g and str(again) == str(g)


def test_malformed_key_trie_forms_are_syntax_errors() -> None:
    for text in ['root ::= %key-set("a"', 'root ::= %key-node("ab"->x)\nx ::= "x"', "root ::= %keys()"]:
        with pytest.raises(GrammarSyntaxError):
            parse_gbnf(text)
    with pytest.raises(GrammarDefinitionError, match="is a leaf"):
        parse_gbnf("root ::= %key-node(ends-name)")
    with pytest.raises(GrammarDefinitionError):  # the rules a key set calls are not defined
        parse_gbnf('root ::= %key-set("a")')
