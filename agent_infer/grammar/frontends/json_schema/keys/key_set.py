"""A whole "any key but these names" trie as one rule body, lowered natively in one step.

Written node by node (:mod:`json_schema_keys`), a Kubernetes schema's ~90 tries became ~1,700
rules, and lowering them (fragment store, equal-rule merging, outlining, FOLLOW sets) was about
half of its compile. When every name is plain printable ASCII (no quote, slash, backslash,
control or non-ASCII character: nearly all property names), the front end instead writes one rule
whose body is a :class:`KeySet` holding only the sorted names. The serializers write it as one
``KEY_TRIE`` instruction (engine_native/src/grammar.h) and the native compiler builds its minimal
automaton directly (grammar_key_set.cpp).

To every other reader of the IR (printer, reference recognizer, reference walks) a KeySet is an
``Alt`` spelling the same automaton, the trie's nodes nested (each child inlined where
:func:`json_schema_keys.node_body` references a rule): the same language as the node-by-node
tries, built only when someone reads ``items``.
"""

from __future__ import annotations

import re
from typing import Any

from agent_infer.grammar.frontends.json_schema.keys.complement_keys import FREE_RULE, SINK_RULE, plain_part
from agent_infer.grammar.frontends.json_schema.keys.names import code_point_gaps
from agent_infer.grammar.ir import Alt, CharClass, Empty, Expr, Ref, Seq

KEY_TRIE_OPCODE = 7
"""``KEY_TRIE`` in engine_native/src/grammar.h (enum Op)."""

# Not printable ASCII, or the quote, slash or backslash (which need or allow escapes).
_NOT_PLAIN = re.compile(r"[^ !#-.0-\[\]-~]")
_REST = Ref(SINK_RULE)
_FREE = Ref(FREE_RULE)

_set = object.__setattr__


def all_plain(names: tuple[str, ...]) -> bool:
    """Whether every name is plain printable ASCII (the names a :class:`KeySet` may hold)."""
    return _NOT_PLAIN.search("".join(names)) is None


class LazyAlt(Alt):
    """An ``Alt`` that stores a compact source (``_args()``) and builds its branches from it
    (``_expand()``) the first time ``items`` is read: never, for a grammar that is only compiled,
    since the serializers write these nodes from their source. Equal to the plain ``Alt`` of the
    same branches, and hashed like it."""

    __slots__ = ("_items",)
    _items: tuple[Expr, ...]

    def _expand(self) -> tuple[Expr, ...]:
        raise NotImplementedError(f"{type(self).__name__} must define _expand")

    def _args(self) -> tuple[Any, ...]:
        raise NotImplementedError(f"{type(self).__name__} must define _args")

    @property
    def items(self) -> tuple[Expr, ...]:
        """The branches, built on first use."""
        try:
            return self._items
        except AttributeError:
            pass
        items = self._expand()
        _set(self, "_items", items)
        return items

    def __eq__(self, other: object) -> bool:
        if type(other) is type(self):
            return self._args() == other._args()
        if isinstance(other, Alt):
            return self.items == other.items
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.items,))  # what the dataclass hash of an equal Alt gives

    def __reduce__(self) -> tuple[Any, ...]:
        # copy/pickle: the frozen dataclass __setattr__ would refuse the default slot state.
        return (type(self), self._args())


class KeySet(LazyAlt):
    """Any JSON object key (between its quotes) other than ``names``: sorted, distinct, plain
    printable ASCII (:func:`all_plain`). Its free branches call ``char-key-rest`` and
    ``char-key-free``, and its expansion ``char-special``, which the grammar must define
    (``json_schema_keys.SINK_RULE``, ``FREE_RULE``, ``SPECIAL_RULE``)."""

    __slots__ = ("_names",)
    _names: tuple[str, ...]

    def __init__(self, names: tuple[str, ...]) -> None:
        _set(self, "_names", names)

    @property
    def names(self) -> tuple[str, ...]:
        """The excluded names."""
        return self._names

    def _args(self) -> tuple[Any, ...]:
        return (self._names,)

    def _expand(self) -> tuple[Expr, ...]:
        # The root node's branches with every trie node nested.
        body = _subtrie(self._names, 0)
        return body.items if isinstance(body, Alt) else (body,)

    def program(self, index: dict[str, int]) -> list[int]:
        """The ``KEY_TRIE`` instruction (the whole rule program), given the grammar's rule index."""
        words = [index[FREE_RULE], index[SINK_RULE], len(self._names)]
        for name in self._names:
            words.append(len(name))
            words.extend(map(ord, name))
        return [KEY_TRIE_OPCODE, len(words), *words]

    def __repr__(self) -> str:
        return f"KeySet(names={self._names!r})"


def _subtrie(words: tuple[str, ...], depth: int) -> Expr:
    """The node reached by ``depth`` shared characters of ``words`` (sorted, distinct), with the
    branches grammar_key_set.cpp gives its state: a plain character that continues no name, then
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
