"""Key tries built natively (``_native.KeyTrieBuilder``, keys/key_trie.py) against the Python
builder (``ComplementKeys``): the same rules in the same order, so the same programs, byte for
byte; ``KeyNode`` bodies read as the ``Alt`` the Python builder writes; limits and cache clearing.
The node builder serves name sets with a character outside plain printable ASCII; here it is made
to serve every set (plain ones otherwise become one ``KeySet`` rule, keys/test_key_set.py)."""

from __future__ import annotations

import copy
import json
import pickle
import random
from collections.abc import Iterator
from typing import Any

import pytest
from conformance import MASKBENCH_DIR
from python_serializer import serialize_grammar_python

from agent_infer.errors import GrammarLimitError
from agent_infer.grammar import clear_grammar_caches
from agent_infer.grammar.compile.serialize import serialize_for_compile, serialize_grammar
from agent_infer.grammar.frontends.json_schema import compiler as json_schema_compiler
from agent_infer.grammar.frontends.json_schema.keys import key_trie as key_trie
from agent_infer.grammar.frontends.json_schema.keys.complement_keys import ComplementKeys, node_body
from agent_infer.grammar.frontends.json_schema.types.string_encoding import HIGH_EXPR, HIGH_RULE
from agent_infer.grammar.ir import Alt, Expr, Grammar, KeyNode, Ref
from agent_infer.grammar.ir import _rename as rename_refs
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer
from agent_infer.native import load_native

# Letters whose trie edges the native serializer writes itself (plain ASCII) and ones it leaves to
# the node's own branches ('/', '"', '\\', controls, non-ASCII).
ALPHABET = 'ab_$-.Z/"\\\x01é中'


@pytest.fixture(autouse=True)
def _needs_native_tries(monkeypatch: pytest.MonkeyPatch) -> None:
    # The extension is required: a build without the native key-trie builder is a failure.
    assert hasattr(load_native(), "KeyTrieBuilder"), "extension built without KeyTrieBuilder"
    # Plain-ASCII name sets take the one-rule KeySet path (tests/keys/test_key_set.py); the
    # node builder tested here serves the others, and every set when this switch is off.
    monkeypatch.setattr(key_trie, "all_plain", lambda names: False)


def _name_sets(seed: int, count: int) -> list[list[str]]:
    rng = random.Random(seed)
    sets = [["a", "ab", "abc"], ["", "c"], ["apiVersion", "kind", "metadata", "spec", "status"]]
    for _ in range(count):
        sets.append(
            [
                "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6)))
                for _ in range(rng.randint(1, 7))
            ]
        )
    return sets


def _object_schema(names: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": {n: {"type": "integer"} for n in names}}


def _schemas() -> Iterator[Any]:
    for names in _name_sets(11, 30):
        yield _object_schema(names)
    # Objects nested in objects and arrays, sharing name sets and suffixes.
    yield {
        "type": "object",
        "properties": {
            "metadata": _object_schema(["name", "namespace", "labels"]),
            "items": {"type": "array", "items": _object_schema(["name", "kind", "apiVersion"])},
            "spec": _object_schema(["replicas", "selector", "template", "name"]),
        },
    }
    if MASKBENCH_DIR.exists():
        for path in sorted(MASKBENCH_DIR.glob("Kubernetes---kb_7*.json"))[:6]:
            yield json.loads(path.read_text())["schema"]


def _build(schema: Any, native: bool, monkeypatch: pytest.MonkeyPatch) -> Grammar:
    original = key_trie.complement_keys

    def keys(rules: Any, max_rules: int) -> key_trie.KeyTries:
        return original(rules, max_rules, native=native)

    with monkeypatch.context() as m:
        m.setattr(json_schema_compiler, "complement_keys", keys)
        return Grammar.from_json_schema(schema, whitespace="compact")


@pytest.mark.parametrize("cold", [True, False])
def test_native_tries_give_the_python_builders_programs(cold: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed (native) programs of the native grammar == Python programs of the Python grammar, and
    the Python serializer reads the native grammar's KeyNode bodies to the same programs."""
    checked = 0
    for schema in _schemas():
        if cold:
            clear_grammar_caches()
        fast = _build(schema, True, monkeypatch)
        if cold:
            clear_grammar_caches()
        slow = _build(schema, False, monkeypatch)
        packed, root = serialize_for_compile(fast)
        assert not isinstance(packed, list), "the native packed serializer was not used"
        reference = serialize_grammar_python(slow)
        assert (packed.programs(), root) == reference, schema
        assert serialize_grammar(fast) == reference
        assert serialize_grammar_python(fast) == reference
        checked += any(isinstance(body, KeyNode) for _, body in fast.rules)
    assert checked >= 30


def test_key_nodes_read_as_the_python_builders_alternations(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule by rule (key-trie names mapped in rule order) the native grammar, its key nodes
    expanded, equals the Python one, prints the same, and accepts exactly the keys outside the
    declared names."""
    names = ["apiVersion", "kind", "a/b", "é", "ab"]
    schema = {**_object_schema(names), "additionalProperties": {"type": "null"}}
    fast = _build(schema, True, monkeypatch)
    slow = _build(schema, False, monkeypatch)
    assert len(fast.rules) == len(slow.rules)
    mapping = {s: f for (f, _), (s, _) in zip(fast.rules, slow.rules, strict=True)}
    renamed = Grammar.unchecked(tuple((mapping[n], _rename(body, mapping)) for n, body in slow.rules))
    expanded = Grammar.unchecked(
        tuple((n, Alt(b.expand()) if isinstance(b, KeyNode) else b) for n, b in fast.rules)
    )
    for (name, body), (_, want) in zip(expanded.rules, renamed.rules, strict=True):
        assert body == want and want == body, name
    assert any(isinstance(body, KeyNode) for _, body in fast.rules)
    assert str(expanded) == str(renamed)
    rec = ReferenceRecognizer(fast)
    assert rec.accepts('{"apiVersion":1,"apiVersio":null,"a/":null,"é!":null,"b":null}')
    assert not rec.accepts('{"a/b":1,"a\\/b":null}')  # the escaped spelling is the same key
    assert not rec.accepts('{"kind":1,"kind":null}')
    assert not rec.accepts('{"\\u00e9":null}')


def _rename(expr: Expr, mapping: dict[str, str]) -> Expr:
    return rename_refs(expr, mapping)


def test_a_key_node_is_the_alt_its_spec_describes() -> None:
    spec = (False, ord("a"), "char-key-x", ord("é"), "char-key-y")
    node = KeyNode(spec)
    want = node_body([(ord("a"), Ref("char-key-x")), (ord("é"), Ref("char-key-y"))], False)
    assert isinstance(want, Alt)
    assert Alt(node.expand()) == want and node != want  # a node kind of its own
    assert node.expand() is node.expand()  # built once
    assert repr(node) == f"KeyNode(spec={spec!r})"
    assert node == KeyNode(spec) and hash(node) == hash(KeyNode(spec))
    assert copy.deepcopy(node) == node and pickle.loads(pickle.dumps(node)) == node


def test_native_tries_share_nodes_and_stop_at_the_rule_limit() -> None:
    rules: dict[str, Expr] = {}
    keys = key_trie.complement_keys(rules, 1_000_000)
    assert isinstance(keys, key_trie.NativeComplementKeys)
    first = keys.start(["spec", "status"])
    assert keys.start(["status", "spec", "spec"]) == first  # order and repeats do not matter
    before = len(rules)
    keys.start(["specs", "status"])  # shares the "tatus" chain
    assert 0 < len(rules) - before < len("specs") + 2
    grammar = Grammar.from_rules({"root": first, HIGH_RULE: HIGH_EXPR, **rules})
    rec = ReferenceRecognizer(grammar)
    assert rec.accepts("spe") and rec.accepts("specs") and not rec.accepts("spec")
    with pytest.raises(GrammarLimitError):
        key_trie.complement_keys({}, 5).start(["a_long_name", "another_one"])
    # The Python builder, as the fallback, agrees on the language.
    slow_rules: dict[str, Expr] = {}
    slow = ComplementKeys(slow_rules, 1_000_000).start(["spec", "status"])
    slow_rec = ReferenceRecognizer(Grammar.from_rules({"root": slow, HIGH_RULE: HIGH_EXPR, **slow_rules}))
    for text in ("", "s", "spec", "spec ", "status", "stat", "x"):
        assert slow_rec.accepts(text) == rec.accepts(text), text


def test_clearing_the_caches_empties_the_native_table() -> None:
    Grammar.from_json_schema(_object_schema(["alpha", "beta"]), whitespace="compact")
    assert load_native().key_trie_nodes() > 0
    clear_grammar_caches()
    assert load_native().key_trie_nodes() == 0
    g = Grammar.from_json_schema(_object_schema(["alpha", "beta"]), whitespace="compact")
    assert ReferenceRecognizer(g).accepts('{"alpha":1,"gamma":2}')


def test_key_nodes_and_their_specs_are_not_gc_tracked() -> None:
    """Key-trie nodes hold a spec of bools, ints and strs (no cycle possible): built untracked, so
    the first collection after a compile does not walk the ~3,500 objects of a big schema's tries."""
    import gc

    clear_grammar_caches()
    g = Grammar.from_json_schema(
        {"type": "object", "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"}}},
        whitespace="compact",
    )
    nodes = [body for _, body in g.rules if isinstance(body, KeyNode)]
    assert nodes
    assert not any(gc.is_tracked(n) or gc.is_tracked(n._spec) for n in nodes)
    assert all(isinstance(n.expand(), tuple) for n in nodes)  # the branches still build on demand
