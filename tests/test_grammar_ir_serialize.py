"""Serialization of IR grammars and grammar validation: the native fast paths against the Python ones.

``serialize_grammar`` writes rule programs in C++ when the extension has ``serialize_rules`` and
``Grammar`` checks references with ``first_missing_ref``; both must give exactly what the Python
walks give (same programs, same first error), and hand anything unusual back to them.
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass

import pytest
from conformance import MASKBENCH_DIR

from agent_infer.errors import AgentInferError, GrammarDefinitionError, GrammarLimitError
from agent_infer.grammar.compile import compiler
from agent_infer.grammar.compile.compiler import serialize_grammar, serialize_grammar_python
from agent_infer.grammar.ir import (
    Alt,
    CharClass,
    Empty,
    Expr,
    Grammar,
    Literal,
    Ref,
    Repeat,
    Seq,
    chars,
    lit,
    seq,
)
from agent_infer.grammar.ir.references import _undefined_ref, first_undefined_ref
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
]


def _native_has(name: str) -> bool:
    return hasattr(load_native(), name)


@pytest.mark.parametrize("whitespace", ["compact", "flexible"])
@pytest.mark.parametrize("n", range(len(SCHEMAS)))
def test_native_programs_equal_python_programs(n: int, whitespace: str) -> None:
    if not _native_has("serialize_rules"):
        pytest.skip("extension built without serialize_rules")
    g = Grammar.from_json_schema(SCHEMAS[n], whitespace=whitespace)
    native = load_native().serialize_rules(
        [e for _, e in g.rules], {n: i for i, (n, _) in enumerate(g.rules)}, compiler._KINDS
    )
    assert native is not None
    assert (native, 0) == serialize_grammar_python(g)
    assert serialize_grammar(g) == serialize_grammar_python(g)


@pytest.mark.skipif(not MASKBENCH_DIR.is_dir(), reason="maskbench-dev data not present")
def test_native_programs_on_a_maskbench_sample() -> None:
    """Programs of real schemas (both serializers), and both reference checks agree."""
    files = sorted(MASKBENCH_DIR.glob("*.json"))
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


def test_errors_come_from_the_python_path() -> None:
    """Nodes the native path does not take (lone surrogates, huge bounds, subclasses) go to Python."""
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


def test_first_undefined_reference_in_rule_then_walk_order() -> None:
    """The reported name is the one a pre-order walk with the last child first meets first."""
    shared = Seq((Ref("ok"), Ref("m1")))
    rules = (
        ("root", Seq((Ref("ok"), lit("x")))),
        ("ok", Alt((shared, Seq((Ref("m2"), shared)), Ref("m3")))),
    )
    names = {"root", "ok"}
    assert _undefined_ref(rules[1][1], names) == "m3"
    assert first_undefined_ref(rules, names) == ("ok", "m3")
    with pytest.raises(GrammarDefinitionError, match="rule 'ok' refers to undefined rule 'm3'"):
        Grammar(rules)
    with pytest.raises(GrammarDefinitionError, match="rule 'root' refers to undefined rule 'm0'"):
        Grammar((("root", seq(Ref("m0"), Ref("ok"))), ("ok", Empty())))


def test_rule_name_checks_report_the_first_problem() -> None:
    with pytest.raises(GrammarDefinitionError, match="rule 'a' is defined twice"):
        Grammar((("root", lit("x")), ("a", lit("y")), ("a", lit("z")), ("b c", lit("w"))))
    with pytest.raises(GrammarDefinitionError, match="invalid rule name 'b c'"):
        Grammar((("root", lit("x")), ("b c", lit("w")), ("a", lit("y")), ("a", lit("z"))))
    assert Grammar((("root", Ref("b-1_Z")), ("b-1_Z", lit("q")))).rules[1][0] == "b-1_Z"
