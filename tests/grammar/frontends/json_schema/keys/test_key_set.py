"""Whole key tries as one ``KeySet`` rule (keys/key_set.py, grammar/lower/key_set.cpp): the same
language and the same token masks as the node-by-node tries they replace, the same programs from
both serializers, never expanded by a compile, and typed errors for malformed KEY_TRIE programs."""

from __future__ import annotations

import copy
import json
import pickle
import random
from typing import Any

import numpy as np
import pytest
from conformance import MASKBENCH_DIR
from grammar_support import hf_tokenizer, tokenizer_info
from python_serializer import KEY_TRIE_OPCODE, serialize_grammar_python

from agent_infer.errors import GrammarDefinitionError, GrammarLimitError
from agent_infer.grammar import GrammarCompiler, GrammarMatcher, clear_grammar_caches
from agent_infer.grammar.compile.serialize import serialize_for_compile
from agent_infer.grammar.frontends.json_schema.keys import key_trie as key_trie
from agent_infer.grammar.frontends.json_schema.keys.complement_keys import FREE_RULE, SINK_RULE
from agent_infer.grammar.frontends.json_schema.keys.key_set import all_plain
from agent_infer.grammar.ir import Alt, Grammar, KeyNode, KeySet
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer
from agent_infer.native import load_native

PLAIN = "abcAB_-.$ 09~!"
# Key characters to probe with: plain ones, and ones needing escapes or several UTF-8 bytes.
PROBE = PLAIN + '"/\\\x01\x7fé中😀'


def _schema(names: list[str]) -> dict[str, Any]:
    # Declared members take strings and extra members integers, so `"name":1` is accepted exactly
    # when the key is outside the names.
    return {"type": "object", "properties": {n: {"type": "string"} for n in names}}


def _grammar(schema: Any, key_sets: bool, monkeypatch: pytest.MonkeyPatch) -> Grammar:
    clear_grammar_caches()
    with monkeypatch.context() as m:
        if not key_sets:
            m.setattr(key_trie, "all_plain", lambda names: False)
        return Grammar.from_json_schema(schema, whitespace="compact")


def _name_sets(seed: int, count: int) -> list[list[str]]:
    rng = random.Random(seed)
    sets = [
        ["a", "ab", "abc"],
        ["", "c"],
        ["apiVersion", "kind", "metadata", "spec", "status"],
        ["~", " ", "!"],
    ]
    for _ in range(count):
        sets.append(
            ["".join(rng.choice(PLAIN) for _ in range(rng.randint(0, 6))) for _ in range(rng.randint(1, 7))]
        )
    return sets


def _probe_keys(names: list[str], rng: random.Random) -> list[str]:
    keys = list(names)
    for _ in range(40):
        if names and rng.random() < 0.6:
            base = rng.choice(names)
            keys.append(
                base[: rng.randint(0, len(base))]
                + "".join(rng.choice(PROBE) for _ in range(rng.randint(0, 2)))
            )
        else:
            keys.append("".join(rng.choice(PROBE) for _ in range(rng.randint(0, 5))))
    return keys


def _encodings(key: str, rng: random.Random) -> list[str]:
    out = [json.dumps(key), json.dumps(key, ensure_ascii=False)]
    if "/" in key:
        out.append(json.dumps(key).replace("/", "\\/"))
    if key:
        i = rng.randrange(len(key))
        out.append(json.dumps(key[:i])[:-1] + f"\\u{ord(key[i]):04x}" + json.dumps(key[i + 1 :])[1:])
    return out


def test_plain_name_sets_become_one_rule_and_others_keep_the_node_tries() -> None:
    clear_grammar_caches()
    g = Grammar.from_json_schema(_schema(["apiVersion", "kind", "spec"]), whitespace="compact")
    sets = [body for _, body in g.rules if isinstance(body, KeySet)]
    assert len(sets) == 1 and sets[0].names == ("apiVersion", "kind", "spec")
    assert not any(isinstance(body, KeyNode) for _, body in g.rules)
    g = Grammar.from_json_schema(_schema(["apiVersion", "a/b"]), whitespace="compact")
    assert not any(isinstance(body, KeySet) for _, body in g.rules)
    assert any(isinstance(body, KeyNode) for _, body in g.rules)
    assert all_plain(("a b", "~!")) and not all_plain(("ok", "é")) and not all_plain(('"',))


@pytest.mark.parametrize("tokenizer", ["smollm2", "deepseek"])
def test_key_sets_accept_and_mask_like_the_node_tries(
    tokenizer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every probe document is accepted by both or neither, and the token masks agree at every
    step of its tokenization (the automaton is new, the language and masks must not be)."""
    info = tokenizer_info(tokenizer)
    comp = GrammarCompiler(info, cache_enabled=False)
    tok = hf_tokenizer(tokenizer)
    rng = random.Random(5)
    words = (info.vocab_size + 31) // 32
    accepted = rejected = steps = 0
    for names in _name_sets(3, 12 if tokenizer == "smollm2" else 4):
        new = comp.compile(_grammar(_schema(names), True, monkeypatch))
        old = comp.compile(_grammar(_schema(names), False, monkeypatch))
        for key in _probe_keys(names, rng):
            for enc in _encodings(key, rng):
                doc = "{" + enc + ":1}"
                a, b = GrammarMatcher(new), GrammarMatcher(old)
                ok = a.accept_string(doc) and a.can_terminate()
                assert ok == (b.accept_string(doc) and b.can_terminate()), (names, doc)
                accepted += ok
                rejected += not ok
        for key in _probe_keys(names, rng)[:8]:
            a, b = GrammarMatcher(new), GrammarMatcher(old)
            ma, mb = np.zeros((1, words), np.int32), np.zeros((1, words), np.int32)
            for token in tok.encode(
                "{" + json.dumps(key, ensure_ascii=False) + ":1}", add_special_tokens=False
            ).ids:
                a.fill_next_token_bitmask(ma)
                b.fill_next_token_bitmask(mb)
                assert np.array_equal(ma, mb), (names, key)
                steps += 1
                if not a.accept_token(token):
                    assert not b.accept_token(token)
                    break
                assert b.accept_token(token)
    assert accepted > 100 and rejected > 20 and steps > 50


def test_the_python_expansion_is_the_same_language(monkeypatch: pytest.MonkeyPatch) -> None:
    """``KeySet.expand()`` (what the reference recognizer reads) against the native
    automaton built from the names alone."""
    comp = GrammarCompiler(tokenizer_info("bytes"), cache_enabled=False)
    rng = random.Random(9)
    checked = 0
    for names in _name_sets(4, 10):
        g = _grammar(_schema(names), True, monkeypatch)
        ref, compiled = ReferenceRecognizer(g), comp.compile(g)
        for key in _probe_keys(names, rng)[:20]:
            doc = "{" + json.dumps(key, ensure_ascii=False) + ":1}"
            m = GrammarMatcher(compiled)
            assert ref.accepts(doc) == (m.accept_string(doc) and m.can_terminate()), (names, doc)
            checked += 1
    assert checked > 200


def test_both_serializers_write_one_key_trie_instruction(monkeypatch: pytest.MonkeyPatch) -> None:
    g = _grammar(_schema(["kind", "apiVersion", "kind2"]), True, monkeypatch)
    packed, root = serialize_for_compile(g)
    assert not isinstance(packed, list)
    lists, root2 = serialize_grammar_python(g)
    assert (packed.programs(), root) == (lists, root2)
    index = {name: i for i, (name, _) in enumerate(g.rules)}
    (rule,) = [i for i, (_, body) in enumerate(g.rules) if isinstance(body, KeySet)]
    payload = [index[FREE_RULE], index[SINK_RULE], 3, 10, *map(ord, "apiVersion"), 4, *map(ord, "kind")]
    payload += [5, *map(ord, "kind2")]
    assert lists[rule] == [KEY_TRIE_OPCODE, len(payload), *payload]


def test_a_compile_never_expands_key_sets() -> None:
    schemas: list[Any] = [
        {
            "type": "object",
            "properties": {
                "metadata": _schema(["name", "labels"]),
                "items": {"type": "array", "items": _schema(["a", "b"])},
            },
        }
    ]
    if MASKBENCH_DIR.exists():
        schemas += [
            json.loads(p.read_text())["schema"]
            for p in sorted(MASKBENCH_DIR.glob("Kubernetes---kb_70*.json"))[:2]
        ]
    comp = GrammarCompiler(tokenizer_info("smollm2"), cache_enabled=False)
    for schema in schemas:
        clear_grammar_caches()
        g = Grammar.from_json_schema(schema, whitespace="compact")
        sets = [body for _, body in g.rules if isinstance(body, KeySet)]
        GrammarMatcher(comp.compile(g)).fill_next_token_bitmask(np.zeros((1, 2000), np.int32))
        assert sets and not any(hasattr(s, "_items") for s in sets)


def test_key_set_value_semantics() -> None:
    k = KeySet(("a", "bc"))
    expanded = Alt(k.expand())
    assert k == KeySet(("a", "bc")) and hash(k) == hash(KeySet(("a", "bc"))) and k != KeySet(("a",))
    assert k != expanded and expanded != k  # a node kind of its own, not the Alt it expands to
    for clone in (copy.copy(k), copy.deepcopy(k), pickle.loads(pickle.dumps(k))):
        assert isinstance(clone, KeySet) and clone == k and clone.names == k.names
    assert repr(k) == "KeySet(names=('a', 'bc'))"


def test_key_sets_count_against_the_rule_limit() -> None:
    rules: dict[str, Any] = {}
    keys = key_trie.complement_keys(rules, 4)
    keys.start(["alpha"])  # char-special, char-key-rest, char-key-free, the set: 4 rules
    assert keys.start(["alpha"]).name == keys.start(["alpha"]).name  # one rule per name set
    with pytest.raises(GrammarLimitError):
        keys.start(["beta"])


def _compile_programs(programs: list[list[int]]) -> Any:
    return load_native().CompiledGrammar(tokenizer_info("bytes")._native, programs, 0, 100_000, 10.0, 100_000)


def test_malformed_key_trie_programs_raise_definition_errors() -> None:
    # root ::= "\"" keys "\""; keys ::= KEY_TRIE(free = 2, rest = 3, names); 2 ::= "\\u"; 3 ::= ""
    def grammar(trie: list[int]) -> list[list[int]]:
        return [[3, 3, 1, 1, 34, 6, 1, 1, 1, 34], trie, [1, 2, 92, 117], [0]]

    def trie(*words: int) -> list[int]:
        return [KEY_TRIE_OPCODE, len(words), *words]

    good = _compile_programs(grammar(trie(2, 3, 2, 1, 97, 2, 97, 98)))
    for text, ok in [
        ('"a"', False),
        ('"ab"', False),
        ('""', True),
        ('"abc"', True),
        ('"b"', True),
        ('"\\u"', True),
    ]:
        native = load_native().GrammarMatcher(good, False, -1)
        assert (native.accept_bytes(text.encode()) and native.can_terminate()) == ok, text
    bad = [
        trie(2, 3, 1, 1, 0x22),  # a quote is not plain
        trie(2, 3, 1, 1, 0xE9),  # nor is é
        trie(2, 9, 0),  # rest rule out of range
        trie(-1, 3, 0),  # free rule out of range
        trie(2, 3, 2, 1, 97),  # a name missing
        trie(2, 3, 1, 5, 97),  # a name past the end
        trie(2, 3, -1),  # negative count
        trie(2, 3, 0, 7),  # a word after the last name
        trie(2, 3, 2, 1, 98, 1, 97),  # names out of order
        trie(2, 3, 2, 1, 97, 1, 97),  # a name twice
        trie(2, 3, 2, 2, 97, 98, 1, 97),  # a prefix after its extension
        [KEY_TRIE_OPCODE, 9, 2, 3, 0],  # payload length wrong
        [3, 2, *trie(2, 3, 0), 0],  # not the whole body
    ]
    for program in bad:
        with pytest.raises(GrammarDefinitionError):
            _compile_programs(grammar(program))
