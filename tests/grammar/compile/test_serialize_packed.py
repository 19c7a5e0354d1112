"""Programs kept native between serialization and compilation, and the cache of shared rule bodies.

``GrammarCompiler.compile`` serializes with ``serialize_packed`` (``SerializedRules``, never turned
into Python ints) and compiles with ``compile_serialized``; rules whose bodies a front end shares
across grammars (JSON Schema: ``char*``) have their programs cached by body object, with rule
indices written per grammar from the names. Everything must equal the Python serializer's output.
"""

from __future__ import annotations

import json
import random
from array import array

import pytest
from grammar_support import tokenizer_info
from python_serializer import program_bytes, serialize_grammar_python
from shared_data import require_shared_data

from agent_infer.errors import AgentInferError, GrammarDefinitionError
from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.compile.serialize import program_key, serialize_for_compile
from agent_infer.grammar.ir import Alt, Grammar, KeySet, Ref, Seq, chars, lit
from agent_infer.grammar.runtime.matcher import GrammarMatcher
from agent_infer.native import load_native

SCHEMAS = [
    {"type": "object", "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"}}},
    {"type": "object", "properties": {"a": {"type": "string", "maxLength": 40}, "b": {"enum": [1, "x"]}}},
    {"type": "array", "items": {"type": "object", "properties": {"kind": {}, "zeta": {"type": "integer"}}}},
    {"type": "string", "pattern": "^[a-z]{2,5}(\\d+|é)$", "minLength": 3},
    {"type": "object", "patternProperties": {"^x-": {"type": "integer"}}, "propertyNames": {"maxLength": 9}},
]


def _packed(grammar: Grammar) -> tuple[list[list[int]], int]:
    programs, root = serialize_for_compile(grammar)
    assert not isinstance(programs, list), "the native packed serializer was not used"
    return programs.programs(), root


@pytest.mark.parametrize("whitespace", ["compact", "flexible"])
def test_packed_programs_equal_python_programs_twice(whitespace: str) -> None:
    """The second round reads shared bodies from the cache, with this grammar's rule indices."""
    for _ in range(2):
        for schema in SCHEMAS:
            g = Grammar.from_json_schema(schema, whitespace=whitespace)
            assert _packed(g) == serialize_grammar_python(g), schema


def test_cached_body_indices_follow_each_grammars_rule_order() -> None:
    shared_body = Alt((Seq((lit("a"), Ref("leaf"))), Seq((chars("0-9"), Ref("char-x")))))
    first = Grammar.unchecked((("root", Ref("char-x")), ("char-x", shared_body), ("leaf", lit("!"))), "root")
    second = Grammar.unchecked(
        (
            ("root", Seq((Ref("char-x"), Ref("leaf")))),
            ("leaf", lit("?")),
            ("pad", lit("p")),
            ("char-x", shared_body),
        ),
        "root",
    )
    for g in (first, second, first, second):
        object.__setattr__(g, "_shared_prefix", "char")
        assert _packed(g) == serialize_grammar_python(g)
    # The body's references point at this grammar's rules: leaf is rule 2 then 1, char-x 1 then 3.
    assert _packed(first)[0][1] == [4, 2, 3, 2, 1, 1, 97, 6, 2, 3, 2, 2, 1, 48, 57, 6, 1]
    assert _packed(second)[0][3] == [4, 2, 3, 2, 1, 1, 97, 6, 1, 3, 2, 2, 1, 48, 57, 6, 3]


def test_undefined_reference_of_an_unchecked_grammar_fails_at_compile() -> None:
    g = Grammar.unchecked((("root", Seq((lit("a"), Ref("nowhere")))),), "root")
    with pytest.raises(GrammarDefinitionError, match="'root' refers to undefined rule 'nowhere'"):
        GrammarCompiler(tokenizer_info("bytes")).compile(g)
    # A cached shared body whose callee is missing in a later grammar: the same error.
    body = Seq((lit("k"), Ref("callee")))
    ok = Grammar.unchecked((("root", Ref("char-k")), ("char-k", body), ("callee", lit("c"))), "root")
    bad = Grammar.unchecked((("root", Ref("char-k")), ("char-k", body)), "root")
    for g in (ok, bad):
        object.__setattr__(g, "_shared_prefix", "char")
    GrammarCompiler(tokenizer_info("bytes"), cache_enabled=False).compile(ok)
    with pytest.raises(GrammarDefinitionError, match="'char-k' refers to undefined rule 'callee'"):
        GrammarCompiler(tokenizer_info("bytes"), cache_enabled=False).compile(bad)


def test_unchecked_falls_back_to_validation_when_the_root_is_not_first() -> None:
    with pytest.raises(GrammarDefinitionError, match="undefined rule 'gone'"):
        Grammar.unchecked((("other", lit("x")), ("root", Ref("gone"))), "root")


def test_bytes_layout_and_cache_key_agree_between_both_forms() -> None:
    g = Grammar.from_json_schema(SCHEMAS[1], whitespace="compact")
    packed, root = serialize_for_compile(g)
    lists, root2 = serialize_grammar_python(g)
    assert root == root2 and len(packed) == len(lists)
    flat = array("i", [len(lists), *map(len, lists)])
    for p in lists:
        flat.extend(p)
    assert packed.tobytes() == flat.tobytes() == program_bytes(lists)
    assert program_key(g, packed, root) == program_key(g, serialize_for_compile(g)[0], root)


def test_compile_serialized_matches_the_list_constructor() -> None:
    info = tokenizer_info("smollm2")
    g = Grammar.from_json_schema(SCHEMAS[0], whitespace="compact")
    packed, root = serialize_for_compile(g)
    lists, _ = serialize_grammar_python(g)
    native = load_native()
    a = native.compile_serialized(info._native, packed, root, 500_000, 30.0, 200_000)
    b = native.CompiledGrammar(info._native, lists, root, 500_000, 30.0, 200_000)
    assert a.num_states == b.num_states and a.memory_bytes() == b.memory_bytes()
    compiled = GrammarCompiler(info, cache_enabled=False).compile(g)
    for text, ok in [('{"apiVersion":"v1","kind":"Pod"}', True), ('{"kind":"x","apiVersion":"v"}', False)]:
        m = GrammarMatcher(compiled)
        assert (m.accept_string(text) and m.can_terminate()) == ok, text


def test_packed_programs_on_a_maskbench_sample() -> None:
    files = sorted(require_shared_data("maskbench-dev").glob("*.json"))
    checked = 0
    for path in random.Random(11).sample(files, 40) * 2:  # twice: the second pass hits the body cache
        try:
            g = Grammar.from_json_schema(json.loads(path.read_text())["schema"], whitespace="compact")
        except AgentInferError:
            continue
        assert _packed(g) == serialize_grammar_python(g), path.name
        checked += 1
    assert checked >= 50


class _Foreign(Seq):
    """A subclass of a node kind, which the native serializer declines (rebuilt as a Seq)."""


def test_compiling_takes_the_walked_ir_out_of_the_cyclic_gc() -> None:
    """IR trees hold no cycles: once serialized for a compile, their nodes, item tuples and the
    grammar's (name, body) pairs are untracked, so the first collection after it skips them."""
    import gc
    import weakref

    info = tokenizer_info("smollm2")
    schema = {"type": "array", "items": {"type": "object", "properties": {"untracked": {"type": "integer"}}}}
    g = Grammar.from_json_schema(schema, whitespace="compact")
    # Bodies built for this grammar (front ends also share process-wide constant bodies, which
    # earlier compiles untracked already).
    nodes = [body for _, body in g.rules if isinstance(body, Seq | Alt | KeySet) and gc.is_tracked(body)]
    assert len(nodes) >= 3
    compiled = GrammarCompiler(info, cache_enabled=False).compile(g)
    assert not any(gc.is_tracked(n) for n in nodes)
    assert not any(gc.is_tracked(n.items) for n in nodes if not isinstance(n, KeySet))
    assert any(isinstance(n, KeySet) for n in nodes)
    assert not any(gc.is_tracked(pair) for pair in g.rules)
    # Reference counting alone still frees them with the grammar.
    probe = weakref.ref(nodes[0])
    del nodes, compiled, g
    gc.collect()
    assert probe() is None


def test_a_grammar_with_declined_nodes_stays_tracked() -> None:
    """Its nodes are serialized through a rebuilt copy, so the originals are not untracked."""
    import gc

    info = tokenizer_info("smollm2")
    body = _Foreign((lit("a"), Ref("b")))
    g = Grammar.unchecked((("root", body), ("b", Alt((lit("x"), lit("y"))))), "root")
    GrammarCompiler(info, cache_enabled=False).compile(g)
    assert gc.is_tracked(body) and all(gc.is_tracked(pair) for pair in g.rules)


def test_compile_serialized_consumes_the_programs() -> None:
    info = tokenizer_info("smollm2")
    g = Grammar.from_json_schema(SCHEMAS[0], whitespace="compact")
    packed, root = serialize_for_compile(g)
    expected = serialize_grammar_python(g)[0]
    assert packed.programs() == expected
    native = load_native().compile_serialized(info._native, packed, root, 500_000, 30.0, 200_000)
    assert native.num_states > 0 and len(packed) == 0
