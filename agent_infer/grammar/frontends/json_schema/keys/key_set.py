"""A whole "any key but these names" trie as one rule body, lowered natively in one step.

Written node by node (:mod:`.keys`), a Kubernetes schema's ~90 tries are ~1,700 rules, and
lowering them (fragment store, equal-rule merging, outlining, FOLLOW sets) is about half of its
compile. When every name is plain printable ASCII (no quote, slash, backslash, control or
non-ASCII character: nearly all property names), the front end instead writes one rule whose body
is a :class:`~agent_infer.grammar.ir.KeySet` (an IR node kind) holding only the sorted names. The
native serializer writes it as one ``KEY_TRIE`` instruction (engine_native/src/grammar/ir/program.h) and the
native compiler builds its minimal automaton directly (grammar/lower/key_set.cpp).

This module registers the KeySet's expansion (``KeySet.expand``), which readers that interpret
the IR node by node use (the reference recognizer, renaming): an ``Alt`` spelling the same
automaton, the trie's nodes nested (each child inlined where :func:`.keys.node_body` references a
rule), the same language as the node-by-node tries, built on first use.
"""

from __future__ import annotations

import re

from agent_infer.grammar.frontends.json_schema.keys.complement_keys import FREE_RULE, SINK_RULE, plain_part
from agent_infer.grammar.frontends.json_schema.keys.names import code_point_gaps
from agent_infer.grammar.ir import Alt, CharClass, Empty, Expr, KeySet, Ref, Seq, register_expansion

# Not printable ASCII, or the quote, slash or backslash (which need or allow escapes).
_NOT_PLAIN = re.compile(r"[^ !#-.0-\[\]-~]")
_REST = Ref(SINK_RULE)
_FREE = Ref(FREE_RULE)


def all_plain(names: tuple[str, ...]) -> bool:
    """Whether every name is plain printable ASCII (the names a :class:`KeySet` may hold)."""
    return _NOT_PLAIN.search("".join(names)) is None


def _expand(node: KeySet) -> tuple[Expr, ...]:
    """The branches of the root node, every trie node nested (what grammar/lower/key_set.cpp builds)."""
    body = _subtrie(node.names, 0)
    return body.items if isinstance(body, Alt) else (body,)


def _subtrie(words: tuple[str, ...], depth: int) -> Expr:
    """The node reached by ``depth`` shared characters of ``words`` (sorted, distinct), with the
    branches grammar/lower/key_set.cpp gives its state: a plain character that continues no name, then
    the rest of the key; the free rule (a special character and the rest); each child; and the end
    of the key unless the node ends a name."""
    ends = False
    children: list[tuple[int, Expr]] = []
    i, n = 0, len(words)
    while i < n:
        word = words[i]
        if len(word) == depth:
            ends = True
            i += 1
            continue
        ch = word[depth]
        j = i + 1
        while j < n and len(words[j]) > depth and words[j][depth] == ch:
            j += 1
        children.append((ord(ch), _subtrie(words[i:j], depth + 1)))
        i = j
    gaps = plain_part(tuple(code_point_gaps([cp for cp, _ in children])[0]))
    branches: list[Expr] = [Seq((CharClass(tuple(gaps)), _REST))] if gaps else []
    branches.append(_FREE)
    branches.extend(Seq((CharClass(((cp, cp),)), sub)) for cp, sub in children)
    if not ends:
        branches.append(Empty())
    return Alt(tuple(branches))


register_expansion(KeySet, _expand)
