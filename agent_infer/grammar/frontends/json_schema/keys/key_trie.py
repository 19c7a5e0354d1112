"""Key tries ("any key but these names") built by the native extension, with lazy node bodies.

:class:`~agent_infer.grammar.frontends.json_schema.keys.complement_keys.ComplementKeys` builds each trie node by
node in Python; on a Kubernetes schema (~90 tries, ~3,000 node lookups, ~1,700 distinct nodes)
that is a third of the front end. ``_native.KeyTrieBuilder`` runs the same construction (same node
shapes, same rule order, rules named ``char-key-nN``) and gives each node a
:class:`~agent_infer.grammar.ir.KeyNode` body (an IR node kind): only its spec, with its branches
(:func:`.keys.node_body`, registered here as its expansion) built the first time Python reads
them. The native serializer writes a node's program straight from the spec, so a grammar that is
only compiled never builds those branches at all. The Python builder is the fallback without the
extension and the reference the tests compare against.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any, Protocol

from agent_infer.errors import GrammarDefinitionError, GrammarLimitError
from agent_infer.grammar.automata import TRIE_MAX_STATES, names_dfa
from agent_infer.grammar.common.memo import register_clearer
from agent_infer.grammar.frontends.json_schema.keys.complement_keys import (
    FREE_EXPR,
    FREE_RULE,
    KEY_RULE_PREFIX,
    SINK_EXPR,
    SINK_RULE,
    SPECIAL_EXPR,
    SPECIAL_RULE,
    ComplementKeys,
    node_body,
)
from agent_infer.grammar.frontends.json_schema.keys.key_set import all_plain
from agent_infer.grammar.ir import Alt, Expr, KeyNode, KeySet, Ref, register_expansion
from agent_infer.native import load_native, optional_native

KEY_SET_PREFIX = KEY_RULE_PREFIX + "set-"
"""Names of the rules whose bodies are :class:`KeySet` tries (never a trie node's name)."""


def _expand(node: KeyNode) -> tuple[Expr, ...]:
    """The branches :func:`.keys.node_body` builds from the node's spec."""
    body = node_body([(cp, Ref(rule)) for cp, rule in node.edges], node.ends_name)
    if not isinstance(body, Alt):  # only a leaf has one branch, and the builders make no leaf KeyNode
        raise GrammarDefinitionError(f"key-trie node {node.spec!r} is a leaf, which is not a KeyNode")
    return body.items


# The leaf every name ends in ("one more character, then anything"): not an Alt, and the same
# expression for every trie, so one library constant.
_LEAF_EXPR = node_body([], True)


class KeyTries(Protocol):
    """What the JSON Schema compiler asks of a key-trie builder."""

    def start(self, names: list[str]) -> Ref:
        """The rule for keys outside ``names``."""
        ...


class NativeComplementKeys:
    """:class:`ComplementKeys` with the trie built natively (see the module docstring)."""

    def __init__(self, rules: MutableMapping[str, Expr], max_rules: int, builder_cls: Any) -> None:
        self._rules = rules
        self._max_rules = max_rules
        self._builder = builder_cls(rules, KeyNode, _LEAF_EXPR, max_rules)
        # Sorted distinct names -> the reference to this grammar's KeySet rule for them.
        self._sets: dict[tuple[str, ...], Ref] = {}

    def start(self, names: list[str]) -> Ref:
        """The rule for keys outside ``names`` (decoded strings, any order, repeats allowed)."""
        distinct = tuple(sorted(set(names)))
        hit = self._sets.get(distinct)
        if hit is not None:
            return hit
        if SINK_RULE not in self._rules:
            self._rules[SPECIAL_RULE] = SPECIAL_EXPR
            self._rules[SINK_RULE] = SINK_EXPR
        if 1 + sum(map(len, distinct)) > TRIE_MAX_STATES:
            names_dfa(list(distinct))  # may be over the automaton limits: the same errors as there
        if all_plain(distinct):
            # The whole trie as one rule, lowered natively in one step (key_set.py).
            if len(self._rules) >= self._max_rules:
                raise GrammarLimitError(f"JSON Schema grammar exceeds {self._max_rules} rules")
            if FREE_RULE not in self._rules:
                self._rules[FREE_RULE] = FREE_EXPR
            rule = f"{KEY_SET_PREFIX}{len(self._sets)}"
            while rule in self._rules:
                rule += "-"
            self._rules[rule] = KeySet(distinct)
            ref = self._sets[distinct] = Ref(rule)
            return ref
        name = self._builder.start(distinct)
        if name is None:
            raise GrammarLimitError(f"JSON Schema grammar exceeds {self._max_rules} rules")
        return Ref(name)


def complement_keys(rules: MutableMapping[str, Expr], max_rules: int, *, native: bool = True) -> KeyTries:
    """The key-trie builder of one grammar: native when the extension has it (and ``native``)."""
    builder = optional_native("KeyTrieBuilder") if native else False
    if builder:
        return NativeComplementKeys(rules, max_rules, builder)
    return ComplementKeys(rules, max_rules)


def _clear_native_nodes() -> None:
    builder = optional_native("KeyTrieBuilder")
    if builder:
        load_native().clear_key_tries()


register_expansion(KeyNode, _expand)
register_clearer(_clear_native_nodes)
