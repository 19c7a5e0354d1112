"""Each distinct subschema is translated once: structural keys (resolve/schema_keys.py) and shared key tries.

Copies of a subschema that differ only in annotations must share one rule; anything that changes
the language (property order, enum values, a property *named* ``description``...) must not.
"Any key but these names" automata share their trie nodes across objects, and each shared node
must be exactly the rule the per-object construction writes, references renamed.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from agent_infer.grammar.automata import names_dfa
from agent_infer.grammar.frontends.json_schema.keys.complement_keys import (
    KEY_RULE_PREFIX,
    SINK_RULE,
    SPECIAL_EXPR,
    SPECIAL_RULE,
    ComplementKeys,
    special_head,
)
from agent_infer.grammar.frontends.json_schema.keys.names import names_complement_rules
from agent_infer.grammar.frontends.json_schema.resolve.schema_keys import SchemaKeys
from agent_infer.grammar.frontends.json_schema.types.automaton_rules import encoded_head
from agent_infer.grammar.frontends.json_schema.types.string_encoding import HIGH_EXPR, HIGH_RULE
from agent_infer.grammar.ir import Alt, Expr, Grammar, Ref, Seq
from agent_infer.grammar.ir import _rename as rename_refs
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer


def _accepts(grammar: Grammar, value: Any) -> bool:
    return ReferenceRecognizer(grammar).accepts(json.dumps(value, separators=(",", ":")))


def _point(description: str) -> dict[str, Any]:
    return {
        "type": "object",
        "description": description,
        "title": description.upper(),
        "x-generator": {"note": description},
        "examples": [{"x": 1}],
        "properties": {"x": {"type": "integer", "description": f"x of {description}"}},
        "required": ["x"],
        "additionalProperties": False,
    }


def test_annotation_only_differences_share_one_rule() -> None:
    keys = SchemaKeys()
    assert keys.key(_point("start")) == keys.key(_point("end"))
    schema = {"type": "object", "properties": {"a": _point("start"), "b": _point("end")}}
    grammar = Grammar.from_json_schema(schema, whitespace="compact")
    bodies = [expr for name, expr in grammar.rules if name.startswith("properties-")]
    # One rule for the object and one for its integer, not two of each.
    assert len(bodies) == 2, [name for name, _ in grammar.rules]
    assert _accepts(grammar, {"a": {"x": 1}, "b": {"x": -2}})
    assert not _accepts(grammar, {"a": {"x": 1}, "b": {"y": 2}})


@pytest.mark.parametrize(
    ("left", "right"),
    [
        # a property named like an annotation is a real property
        ({"properties": {"description": {"type": "string"}}}, {"properties": {"title": {"type": "string"}}}),
        # declared order is the member order of the grammar
        (
            {"properties": {"a": {"type": "integer"}, "b": {"type": "string"}}},
            {"properties": {"b": {"type": "string"}, "a": {"type": "integer"}}},
        ),
        # enum objects are written in their key order; numbers keep their spelling
        ({"enum": [{"p": 1, "q": 2}]}, {"enum": [{"q": 2, "p": 1}]}),
        ({"const": 1}, {"const": 1.5}),
        ({"const": 1}, {"const": True}),
        ({"enum": [1]}, {"enum": [1.0]}),
        ({"enum": ["a", "b"]}, {"enum": ["b", "a"]}),
        ({"minimum": 0.0}, {"minimum": -0.0}),
        ({"required": ["a", "b"]}, {"required": ["b", "a"]}),
        # $id changes what relative references resolve against
        ({"$id": "https://a.example/s"}, {"$id": "https://b.example/s"}),
        ({"type": "string"}, {"type": "string", "minLength": 1}),
        ({"items": {"type": "string"}}, {"items": {"type": "string", "format": "date"}}),
    ],
)
def test_language_changes_give_distinct_keys(left: dict[str, Any], right: dict[str, Any]) -> None:
    keys = SchemaKeys()
    assert keys.key(left) != keys.key(right)


def test_keyword_order_and_nested_annotations_do_not_matter() -> None:
    keys = SchemaKeys()
    a = {"type": "array", "items": {"type": "string", "description": "one"}, "maxItems": 3}
    b = {"maxItems": 3, "items": {"description": "two", "type": "string"}, "type": "array"}
    assert keys.key(a) == keys.key(b)
    assert keys.key(True) != keys.key(False) != keys.key({})


def test_objects_in_different_declared_orders_keep_their_own_order() -> None:
    """Two objects equal up to property order (each listing `required` in its own order): each
    accepts only its own order."""
    ab = {"properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
    ba = {"properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}, "required": ["b", "a"]}
    for spec in (ab, ba):
        spec["additionalProperties"] = False
    grammar = Grammar.from_json_schema(
        {"type": "object", "properties": {"p": ab, "q": ba}, "required": ["p", "q"]}, whitespace="compact"
    )
    assert ReferenceRecognizer(grammar).accepts('{"p":{"a":1,"b":2},"q":{"b":2,"a":1}}')
    assert not ReferenceRecognizer(grammar).accepts('{"p":{"a":1,"b":2},"q":{"a":1,"b":2}}')


def test_key_survives_equal_objects_built_later() -> None:
    """Keys are cached by identity; a later object at a reused address must not get a stale key."""
    keys = SchemaKeys()
    seen = {keys.key({"type": "integer", "minimum": i}) for i in range(200)}
    assert len(seen) == 200


NAME_SETS = [
    ["base", "height", "length", "radius", "width"],
    ["name", "namespace", "labels", "annotations"],
    ["apiVersion", "kind", "metadata", "spec", "status"],
    ["a", "ab", ""],
    ["é", "e\u0301", "\U0001f600x"],
    [f"key{i}" for i in range(40)],
]


class _KeepOthers(dict[str, str]):
    """A renaming that keeps names it does not list (char-high is a grammar-wide rule)."""

    def __missing__(self, name: str) -> str:
        return name


def _rename(expr: Expr, mapping: dict[str, str]) -> Expr:
    return rename_refs(expr, _KeepOthers(mapping))


def test_shared_trie_nodes_are_the_per_object_rules_renamed() -> None:
    """With every name set interned in one table, each trie node's shared rule is exactly the rule
    names_complement_rules writes for it, references renamed to the shared nodes."""
    rules: dict[str, Expr] = {}
    shared = ComplementKeys(rules, 1_000_000)
    total_nodes = 0
    for names in NAME_SETS:
        trie = names_dfa(names)
        start = shared.start(names)
        _, own = names_complement_rules(names, "own-", trie, head=special_head)
        total_nodes += len(own)
        # Recover the node -> shared rule mapping by walking both systems in step from the root.
        mapping = {"own-0": start.name, f"own-{len(trie.edges)}": SINK_RULE}
        for s, out in enumerate(trie.edges):
            for _, _, child in out:
                own_body = dict(own)[f"own-{s}"]
                assert isinstance(own_body, Alt | Seq)
                # The child's shared rule is the one the parent's shared body refers to for its code point.
                parent = rules[mapping[f"own-{s}"]]
                mapping.setdefault(f"own-{child}", _child_ref(parent, own_body, f"own-{child}"))
        for name, body in own:
            assert rules[mapping[name]] == _rename(body, mapping), (names, name)
    # Sharing happened: fewer rules than trie nodes over all sets (leaves alone are one rule).
    assert len(rules) < total_nodes
    assert all(name.startswith(KEY_RULE_PREFIX) for name in rules if name != SPECIAL_RULE)


def test_trie_nodes_are_shared_across_grammars_consistently() -> None:
    """A second grammar reuses the first one's node rules and holds every rule it refers to."""
    schema_a = {"type": "object", "properties": {"apiVersion": {}, "kind": {}, "zeta": {}}}
    schema_b = {"type": "object", "properties": {"apiVersion": {}, "kind": {}, "omega": {}}}
    a = Grammar.from_json_schema(schema_a, whitespace="compact")
    b = Grammar.from_json_schema(schema_b, whitespace="compact")
    keys_a = {n for n, _ in a.rules if n.startswith(KEY_RULE_PREFIX)}
    keys_b = {n for n, _ in b.rules if n.startswith(KEY_RULE_PREFIX)}
    assert keys_a & keys_b - {SINK_RULE}  # e.g. the nodes spelling "...ind" and "...ersion"
    rec = ReferenceRecognizer(b)
    assert rec.accepts('{"apiVersion":1,"kind":2,"omega":3,"zeta":4}')
    assert not rec.accepts('{"apiVersion":1,"kind":2,"omega":3,"kind":4}')
    assert rec.accepts('{"apiVersio":1}') and rec.accepts('{"kinds":[]}')


def test_other_rules_never_take_the_key_trie_prefix() -> None:
    from agent_infer.grammar.frontends.json_schema.rule_writer import _rule_base

    assert not _rule_base("/properties/char-key-7").startswith(KEY_RULE_PREFIX)
    assert not _rule_base("char-key-7").startswith(KEY_RULE_PREFIX)
    schema = {"type": "object", "properties": {"char-key-0": {"type": "string"}}, "required": ["char-key-0"]}
    grammar = Grammar.from_json_schema({"$defs": {"x": schema}, "$ref": "#/$defs/x"}, whitespace="compact")
    assert ReferenceRecognizer(grammar).accepts('{"char-key-0":"v","char-key-1":2}')


def _child_ref(shared_body: Expr, own_body: Expr, own_child: str) -> str:
    """The reference in ``shared_body`` at the position where ``own_body`` refers to ``own_child``."""
    own_items = own_body.items if isinstance(own_body, Alt) else (own_body,)
    shared_items = shared_body.items if isinstance(shared_body, Alt) else (shared_body,)
    for mine, theirs in zip(own_items, shared_items, strict=True):
        if isinstance(mine, Seq) and mine.items[-1] == Ref(own_child):
            assert isinstance(theirs, Seq) and isinstance(theirs.items[-1], Ref)
            return theirs.items[-1].name
    raise AssertionError(f"{own_child} not referenced")


def test_kubernetes_like_objects_share_key_rules_and_keep_their_language() -> None:
    meta = {"type": "object", "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}}}
    spec = {"type": "object", "properties": {"replicas": {"type": "integer"}, "name": {"type": "string"}}}
    schema = {"type": "object", "properties": {"metadata": meta, "spec": spec}}
    grammar = Grammar.from_json_schema(schema, whitespace="compact")
    rec = ReferenceRecognizer(grammar)
    assert rec.accepts('{"metadata":{"name":"a","other":1},"spec":{"replicas":2,"names":"x"}}')
    assert not rec.accepts('{"metadata":{"namespace":"a","name":"b"}}')  # declared order
    assert not rec.accepts('{"spec":{"replicas":1,"replicas":2}}')  # a declared name as an extra key
    assert rec.accepts('{"spec":{"replica":1}}')
    assert not rec.accepts('{"metadata":{"name":"a","name":"b"}}')


def _encodings(cp: int) -> list[str]:
    """Every way JSON can spell code point ``cp`` inside a string (and a few ways it cannot)."""
    ch = chr(cp)
    out = [ch, f"\\u{cp:04x}", f"\\u{cp:04X}"] if cp <= 0xFFFF else [ch]
    if cp > 0xFFFF:
        hi, lo = divmod(cp - 0x10000, 0x400)
        out += [f"\\u{0xD800 + hi:04x}\\u{0xDC00 + lo:04x}", f"\\u{0xD800 + hi:04X}\\u{0xDC00 + lo:04X}"]
    out += [json.dumps(ch)[1:-1], "\\/" if ch == "/" else "\\" + ch]
    return out


GAP_SETS = [
    ((0x00, 0x60), (0x62, 0x6D), (0x6F, 0x10FFFF)),  # "any character but a and n"
    ((0x00, 0x10FFFF),),
    ((0x00, 0x2E), (0x30, 0x10FFFF)),  # everything but "/": not every special code point
    ((0x00, 0x40), (0x5B, 0x10FFFF)),
    ((0x61, 0x61),),
    ((0xE9, 0xE9),),
]


@pytest.mark.parametrize("ranges", GAP_SETS)
def test_special_head_has_the_language_of_the_inline_encoding(ranges: tuple[tuple[int, int], ...]) -> None:
    inline = Grammar((("root", Seq(encoded_head(ranges))), (HIGH_RULE, HIGH_EXPR)), "root")
    split = Grammar(
        (("root", Seq(special_head(ranges))), (SPECIAL_RULE, SPECIAL_EXPR), (HIGH_RULE, HIGH_EXPR)), "root"
    )
    a, b = ReferenceRecognizer(inline), ReferenceRecognizer(split)
    points = [*range(0x00, 0x100), 0x7FF, 0x800, 0xD7FF, 0xE000, 0xFFFF, 0x10000, 0x1F600, 0x10FFFF]
    for cp in points:
        for text in _encodings(cp):
            assert a.accepts(text) == b.accepts(text), (ranges, text)
    assert a.accepts("a") == b.accepts("a") and not b.accepts("") and not b.accepts("ab")


def test_key_tries_respect_the_rule_limit() -> None:
    from agent_infer.errors import GrammarLimitError

    with pytest.raises(GrammarLimitError, match="exceeds 5 rules"):
        ComplementKeys({}, 5).start([f"name{i}" for i in range(10)])


def test_a_failed_build_leaves_no_reference_cycle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiler's memos hold closures over the compiler; released when the build fails, its
    rules are freed by reference counting instead of waiting for a cyclic collection."""
    import gc

    from agent_infer.errors import UnsupportedSchemaError
    from agent_infer.grammar import Grammar
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler
    from agent_infer.grammar.frontends.json_schema.types.pattern_regions import MAX_PATTERNS

    props: dict[str, Any] = {
        f"p{i}": {"type": "string", "enum": ["a", "b", 3], "options": {"i": i}} for i in range(40)
    }
    props["q"] = {"type": "object", "properties": {f"r{i}": {"type": "integer"} for i in range(40)}}
    # Found while lowering, after the members above: more pattern regions than the key automaton
    # takes (an unsupported keyword use, which strict mode refuses).
    regions = {f"^x{i}": {"type": "integer", "minimum": i} for i in range(MAX_PATTERNS + 1)}
    props["zz"] = {"type": "object", "patternProperties": regions}
    schema = {"type": "object", "properties": props, "required": sorted(props)}

    def garbage_after_failure() -> int:
        gc.collect()
        with pytest.raises(UnsupportedSchemaError, match="too many patternProperties"):
            Grammar.from_json_schema(schema)
        return gc.collect()

    assert garbage_after_failure() < 50
    monkeypatch.setattr(Compiler, "release", lambda self: None)
    assert garbage_after_failure() > 500  # the cycle the release breaks (so the check can fail)
