"""Key tries ("any key but these names") built from cached pieces: whole tries by name set, and the
chains of nodes that spell a name's last letters by suffix. Every cached piece must give the same
language as a trie built node by node, in any grammar and in any order of building."""

from __future__ import annotations

import random

from agent_infer.grammar.frontends.json_schema.keys.complement_keys import _CHAINS, ComplementKeys
from agent_infer.grammar.frontends.json_schema.types.string_encoding import HIGH_EXPR, HIGH_RULE
from agent_infer.grammar.ir import Grammar
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer

ALPHABET = "abcé_"


def _name_sets(seed: int, count: int) -> list[list[str]]:
    rng = random.Random(seed)
    sets = []
    for _ in range(count):
        size = rng.randint(1, 6)
        names = ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 5))) for _ in range(size)]
        sets.append(names)
    # Names that are prefixes of others, and suffixes shared between sets.
    sets += [["a", "ab", "abc"], ["abc", "xbc", "bc"], ["", "c"], ["ca", "cab", "cb"]]
    return sets


def _probes(names: list[str], rng: random.Random) -> list[str]:
    out = set(names)
    for n in names:
        out.update(n[:k] for k in range(len(n)))
        out.update(n + ch for ch in ALPHABET)
        if n:
            out.add(n[:-1] + ("a" if n[-1] != "a" else "b"))
    out.update("".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 6))) for _ in range(20))
    return sorted(out)


def _language_ok(keys: ComplementKeys, rules: dict, names: list[str], rng: random.Random) -> None:
    start = keys.start(names)
    grammar = Grammar.from_rules({"root": start, HIGH_RULE: HIGH_EXPR, **rules})
    rec = ReferenceRecognizer(grammar)
    for text in _probes(names, rng):
        assert rec.accepts(text) == (text not in names), (names, text)


def test_cached_tries_and_chains_keep_the_language() -> None:
    rng = random.Random(5)
    sets = _name_sets(7, 40)
    # Built once node by node (caches cold for these letters), then again from the caches, in
    # another grammar and in another order.
    for order in (sets, list(reversed(sets))):
        rules: dict = {}
        keys = ComplementKeys(rules, 1_000_000)
        for names in order:
            _language_ok(keys, rules, names, rng)


def test_a_chain_hit_adds_every_rule_it_refers_to() -> None:
    first: dict = {}
    ComplementKeys(first, 1_000_000).start(["qb_chain_tail", "qc"])
    assert "_chain_tail" in _CHAINS  # the letters below the branching "b" of "qb..."
    chain_rules = {ref.name for ref, _ in _CHAINS["_chain_tail"]}
    second: dict = {}
    start = ComplementKeys(second, 1_000_000).start(["zb_chain_tail", "zd"])  # the same chain below "zb"
    assert chain_rules <= set(second) and chain_rules <= set(first)
    grammar = Grammar.from_rules({"root": start, HIGH_RULE: HIGH_EXPR, **second})  # every reference defined
    rec = ReferenceRecognizer(grammar)
    assert not rec.accepts("zb_chain_tail") and not rec.accepts("zd")
    assert rec.accepts("zb_chain_tai") and rec.accepts("zb_chain_tails") and rec.accepts("qb_chain_tail")
