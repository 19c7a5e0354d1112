"""Serialization of IR grammars: the native serializer against the Python oracle
(``tests/support/python_serializer.py``), same programs and same first error, and what it declines
(subclasses of node kinds, lone surrogates, huge bounds) rebuilt from declared kinds or reported.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass

import pytest
from python_serializer import serialize_grammar_python
from shared_data import require_shared_data

from agent_infer.errors import AgentInferError, GrammarDefinitionError, GrammarLimitError
from agent_infer.grammar.compile.serialize import serialize_grammar
from agent_infer.grammar.ir import (
    NODE_KINDS,
    Alt,
    BoundedString,
    CharClass,
    Empty,
    Expr,
    Grammar,
    KeySet,
    Literal,
    Ref,
    Repeat,
    Seq,
    UniqueItem,
    chars,
    lit,
    seq,
)
from agent_infer.grammar.ir.references import first_undefined_ref
from agent_infer.native import load_native

SCHEMAS = [
    {
        "type": "object",
        "properties": {"a": {"type": "string", "maxLength": 40}, "b": {"enum": [1, "x", None]}},
    },
    {"type": "array", "items": {"type": "number", "minimum": -2.5, "maximum": 1e3}, "maxItems": 70},
    {"type": "object", "patternProperties": {"^x-": {"type": "integer"}}, "propertyNames": {"maxLength": 9}},
    {"type": "string", "pattern": "^[a-z]{2,5}(\\d+|é)$", "minLength": 3},
    {"$defs": {"n": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/n"}]}}, "$ref": "#/$defs/n"},
    {"type": "string", "format": "date-time"},
    {"oneOf": [{"const": "a"}, {"type": "integer", "multipleOf": 3}]},
    # Key tries: a KeySet rule (plain names) and KeyNode rules (a name with '/' and one with 'é').
    {"type": "object", "properties": {"apiVersion": {}, "kind": {}}},
    {"type": "object", "properties": {"a/b": {}, "é": {"type": "null"}, "ab": {}}},
    # Unique array items: UniqueItem rules (the UNIQUE word before the item's program).
    {"type": "array", "items": {"type": ["string", "integer"]}, "uniqueItems": True},
    # A BoundedString rule (MAX_LENGTH n before the string's program): a format whose product
    # with the bound is too large to build.
    {"type": "string", "format": "email", "maxLength": 300},
]


@pytest.mark.parametrize("whitespace", ["compact", "flexible"])
@pytest.mark.parametrize("n", range(len(SCHEMAS)))
def test_native_programs_equal_python_programs(n: int, whitespace: str) -> None:
    g = Grammar.from_json_schema(SCHEMAS[n], whitespace=whitespace)
    native = load_native().serialize_rules(
        [e for _, e in g.rules], {n: i for i, (n, _) in enumerate(g.rules)}, NODE_KINDS
    )
    assert native is not None
    assert (native, 0) == serialize_grammar_python(g)
    assert serialize_grammar(g) == serialize_grammar_python(g)


def test_native_programs_on_a_maskbench_sample() -> None:
    """Programs of real schemas (both serializers), and both reference checks agree."""
    files = sorted(require_shared_data("maskbench-dev").glob("*.json"))
    checked = 0
    for path in random.Random(4).sample(files, 40):
        try:
            g = Grammar.from_json_schema(json.loads(path.read_text())["schema"], whitespace="compact")
        except AgentInferError:  # unsupported, invalid or too large: no program to compare
            continue
        assert serialize_grammar(g) == serialize_grammar_python(g), path.name
        names = {name for name, _ in g.rules}
        assert first_undefined_ref(g.rules, names) is None
        checked += 1
    assert checked >= 25


def test_shared_subtrees_are_copied_not_rewalked_the_same() -> None:
    """A node used in several rules and several times in one rule writes the same program each time."""
    shared = Seq((lit("ab"), Repeat(chars("x-z"), 2, None), Ref("r1")))
    twice = Alt((shared, Seq((shared, lit("!"))), shared))
    g = Grammar((("root", Seq((twice, Ref("r1")))), ("r1", Alt((shared, Empty())))))
    programs, root = serialize_grammar(g)
    assert (programs, root) == serialize_grammar_python(g)
    assert programs[0][:2] == [3, 2]  # Seq of 2


def test_declined_nodes_are_rebuilt_or_reported() -> None:
    """Nodes the native serializer does not take as they are: lone surrogates and huge bounds are
    reported as the oracle reports them, subclasses of node kinds are written as their kind."""
    with pytest.raises(GrammarDefinitionError, match="lone surrogate"):
        serialize_grammar(Grammar.from_expr(seq(lit("a"), Literal("\ud800"))))
    with pytest.raises(GrammarLimitError, match="too large"):
        serialize_grammar(Grammar.from_expr(Repeat(lit("a"), 0, 2**31)))

    @dataclass(frozen=True)
    class Shout(Literal):
        pass

    g = Grammar.from_expr(seq(Shout("hey"), CharClass(((0x41, 0x5A), (0x30, 0x39)), negated=True)))
    assert serialize_grammar(g) == serialize_grammar_python(g)
    assert serialize_grammar(g)[0][0][:5] == [3, 2, 1, 3, ord("h")]


def test_deep_nesting_falls_back_to_the_iterative_walk() -> None:
    expr: Expr = lit("x")
    for _ in range(sys.getrecursionlimit() + 50):
        expr = Repeat(Seq((expr, lit("y"))), 0, 1)
    g = Grammar.from_expr(expr)
    programs, _ = serialize_grammar(g)
    assert programs == serialize_grammar_python(g)[0]
    assert programs[0][:3] == [5, 0, 1]


def test_a_nested_key_set_is_written_as_its_expansion() -> None:
    """A KeySet is one KEY_TRIE instruction only as a whole rule body; nested, the serializer
    writes the alternation it expands to (the oracle does the same), with shared subtrees."""
    g = Grammar.from_json_schema({"type": "object", "properties": {"kind": {}}}, whitespace="compact")
    (name, key_set) = next((n, b) for n, b in g.rules if isinstance(b, KeySet))
    shared = Seq((lit("<"), key_set))
    rules = tuple((n, Alt((shared, Seq((shared, lit("!")))))) if n == name else (n, b) for n, b in g.rules)
    nested = Grammar.unchecked(rules, g.root)
    programs, _ = serialize_grammar(nested)
    assert (programs, 0) == serialize_grammar_python(nested)
    assert programs[[n for n, _ in g.rules].index(name)][:2] == [4, 2]  # an Alt, not KEY_TRIE


def test_a_unique_item_is_a_marker_word_and_only_a_rule_body() -> None:
    """A UniqueItem rule is the UNIQUE word, then its item's program; nested anywhere else it is
    refused by both serializers' paths."""
    g = Grammar.from_ebnf('root ::= "[" item ("," item)* "]"\nitem ::= %unique("a" | [0-9]+)\n')
    programs, _ = serialize_grammar(g)
    assert (programs, 0) == serialize_grammar_python(g)
    assert programs[1][:3] == [8, 4, 2]  # UNIQUE, then an Alt of 2
    nested = Grammar.unchecked((("root", Seq((lit("["), UniqueItem(lit("a"))))),), "root")
    with pytest.raises(GrammarDefinitionError, match="whole rule body"):
        serialize_grammar(nested)


def test_a_bounded_string_is_two_marker_words_and_only_a_rule_body() -> None:
    """A BoundedString rule is MAX_LENGTH and its bound, then its item's program; nested anywhere
    else, or with a bound beyond int32, it is refused by both serializers' paths."""
    g = Grammar.from_ebnf('root ::= "[" s "]"\ns ::= %max-length(7 "\\"" [a-z]* "\\"")\n')
    programs, _ = serialize_grammar(g)
    assert (programs, 0) == serialize_grammar_python(g)
    assert programs[1][:3] == [9, 7, 3]  # MAX_LENGTH 7, then a Seq
    nested = Grammar.unchecked((("root", Seq((lit("["), BoundedString(lit('""'), 1)))),), "root")
    with pytest.raises(GrammarDefinitionError, match="whole rule body"):
        serialize_grammar(nested)
    huge = Grammar.unchecked((("root", lit("[")), ("s", BoundedString(lit('""'), 2**31))), "root")
    with pytest.raises(GrammarLimitError, match="too large"):
        serialize_grammar(huge)
