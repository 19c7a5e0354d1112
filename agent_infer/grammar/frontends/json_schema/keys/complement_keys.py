"""Rules for "any key but these names", shared node by node across every object of one grammar.

An object without ``additionalProperties: false`` accepts any key except its declared names; the
front end reads that language off the names' trie (:func:`names_complement_rules`). Objects with
different names still share most of the trie's shape: every name's last node ("one more character,
then anything") is the same rule, and so is every node whose remaining suffixes are equal
(``...Name``, ``...Selector``, ``...Seconds``). Kubernetes schemas inline hundreds of objects, so
writing each trie separately would give thousands of equal rules for the native compiler to find
and merge. Building each trie bottom-up and interning a node by (does it end a name, its
children's code points, their rules) writes each distinct node once. A node's rule depends on
nothing else, so the table is process-wide (rules named ``char-key-N``): the next grammar with an
``apiVersion``/``kind``/``metadata`` object reuses the nodes instead of building them again.

Most edges of such a trie are "any character but these few letters": a class holding every
control, quote, backslash, slash and non-ASCII code point, whose JSON encoding is a dozen escape
alternatives. Those alternatives are the same in every such class, so they live in one rule,
:data:`SPECIAL_RULE`, and an edge is ``[its plain printable ASCII] | char-special``: the same
language in about a third of the program words, and one automaton fragment that the native
compiler lowers once and splices into every caller instead of re-expanding per edge.

With the native extension the JSON Schema compiler builds the same tries natively
(``keys/key_trie.py``); :class:`ComplementKeys` is the fallback and the reference it is
tested against.
"""

from __future__ import annotations

import itertools
from collections.abc import MutableMapping, Sequence
from typing import Any

from agent_infer.errors import GrammarLimitError
from agent_infer.grammar.automata import TRIE_MAX_STATES, names_dfa
from agent_infer.grammar.common.memo import register_cache
from agent_infer.grammar.frontends.json_schema.keys.names import code_point_gaps, complement_sink
from agent_infer.grammar.frontends.json_schema.types.automaton_rules import encoded_head
from agent_infer.grammar.frontends.json_schema.types.string_encoding import MAX_CP, encode_class
from agent_infer.grammar.ir import Alt, CharClass, Empty, Expr, Ref, Seq

SPECIAL_RULE = "char-special"
# Code points whose JSON encoding is not just themselves: controls, '"', '/', '\\', DEL and up.
_SPECIAL = ((0x00, 0x1F), (0x22, 0x22), (0x2F, 0x2F), (0x5C, 0x5C), (0x7F, MAX_CP))
# The rest of printable ASCII: a class of these encodes as itself (raw only).
_PLAIN = ((0x20, 0x21), (0x23, 0x2E), (0x30, 0x5B), (0x5D, 0x7E))
SPECIAL_EXPR: Expr = encode_class(CharClass(_SPECIAL))
_SPECIAL_REF = Ref(SPECIAL_RULE)
# Printable, yet not plain: '"' and '\\' must be escaped, '/' may be.
_ESCAPED_LIST = (0x22, 0x2F, 0x5C)
_ESCAPED_ASCII = frozenset(_ESCAPED_LIST)
_HEADS: dict[tuple[tuple[int, int], ...], tuple[Expr, ...]] = {}
_MAX_HEADS = 8192


def _covers(ranges: tuple[tuple[int, int], ...], part: tuple[tuple[int, int], ...]) -> bool:
    """Whether the sorted disjoint ``ranges`` include every code point of ``part`` (sorted,
    disjoint): one merge pass, since a trie node's gap list can be long."""
    i, n = 0, len(ranges)
    for a, b in part:
        while i < n and ranges[i][1] < a:
            i += 1
        if i == n or ranges[i][0] > a or ranges[i][1] < b:
            return False
    return True


def plain_part(ranges: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The code points of the sorted disjoint ``ranges`` that lie in :data:`_PLAIN`, in order:
    printable ASCII split at the three escaped characters (written out, not a loop over
    ``_PLAIN`` per range, which would be most of the cost of a trie node's gap edge)."""
    out: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if hi < 0x20 or lo > 0x7E:
            continue
        lo = max(lo, 0x20)
        hi = min(hi, 0x7E)
        for x in _ESCAPED_LIST:
            if lo <= x <= hi:
                if lo < x:
                    out.append((lo, x - 1))
                lo = x + 1
        if lo <= hi:
            out.append((lo, hi))
    return tuple(out)


def special_head(ranges: tuple[tuple[int, int], ...]) -> tuple[Expr, ...]:
    """The JSON encodings of one code point of ``ranges`` (sorted, disjoint), as sequence items,
    with the escape alternatives of a class that holds every special code point referenced
    through :data:`SPECIAL_RULE` (which the caller defines as :data:`SPECIAL_EXPR`)."""
    head = _HEADS.get(ranges)
    if head is None:
        cp = ranges[0][0] if len(ranges) == 1 and ranges[0][0] == ranges[0][1] else -1
        if 0x20 <= cp <= 0x7E and cp not in _ESCAPED_ASCII:
            # One printable character of a name (most edges): encode_class would return the class.
            head = (CharClass(ranges),)
        elif _covers(ranges, _SPECIAL):
            plain = plain_part(ranges)
            head = (Alt((CharClass(plain), _SPECIAL_REF)),) if plain else (_SPECIAL_REF,)
        else:
            head = encoded_head(ranges)
        if len(_HEADS) >= _MAX_HEADS:
            _HEADS.clear()
        _HEADS[ranges] = head
    return head


KEY_RULE_PREFIX = "char-key-"
"""Names of the shared key-trie rules (the JSON compiler never gives other rules such names)."""
SINK_RULE = KEY_RULE_PREFIX + "rest"
_SINK_REF = Ref(SINK_RULE)
# Trie node -> (its rule's reference, body), for the whole process: a node's body depends only on
# its key (whether it ends a name, its children's code points and rule names), so every grammar
# that meets the node reuses both, and names never clash (a counter; a name is never reused,
# even after the table is cleared, so entries made before and after a clear never mix).
_NODES: dict[tuple[object, ...], tuple[Ref, Expr]] = {}
_MAX_NODES = 1 << 14
_NEXT_ID = itertools.count()
# Sorted distinct names -> (the trie's start rule, every rule it needs): the same name sets recur
# across grammars (an ObjectMeta or LabelSelector object in every Kubernetes schema), and a hit
# only has to copy the rules instead of interning each trie node again. The rules of one entry
# are consistent among themselves (names are never reused), whatever happened to _NODES since.
_TRIES: dict[tuple[str, ...], tuple[Ref, tuple[tuple[str, Expr], ...]]] = {}
# Suffix -> the chain of nodes spelling it (leaf first, its top last), see ComplementKeys._close.
_CHAINS: dict[str, tuple[tuple[Ref, Expr], ...]] = {}
_MAX_TRIES = 4096


class ComplementKeys:
    """The complement-trie rules of one grammar, added to ``rules`` as tries need them (at most
    ``max_rules`` rules in all, the front end's limit)."""

    def __init__(self, rules: MutableMapping[str, Expr], max_rules: int) -> None:
        self._rules = rules
        self._max_rules = max_rules
        # This grammar's nodes: a key keeps one rule within a grammar even if another thread
        # replaces the process-wide entry meanwhile.
        self._nodes: dict[tuple[object, ...], tuple[Ref, Expr]] = {}
        # The nodes of the trie being built, in interning order (for _TRIES).
        self._used: list[tuple[Ref, Expr]] = []

    def start(self, names: list[str]) -> Ref:
        """The rule for keys outside ``names`` (decoded strings, any order, repeats allowed).

        Built like a minimal acyclic automaton from sorted words (Daciuk et al.): the path of the
        previous name stays open, and when the next name leaves it, the nodes below the common
        prefix are final and get interned, children before parents, each child in code point order.
        """
        distinct = tuple(sorted(set(names)))
        if SINK_RULE not in self._rules:
            self._rules[SPECIAL_RULE] = SPECIAL_EXPR
            self._rules[SINK_RULE] = _SINK_EXPR
        hit = _TRIES.get(distinct)
        if hit is not None:
            rules = self._rules
            added = sum(1 for name, _ in hit[1] if name not in rules)
            if len(rules) + added > self._max_rules:
                raise GrammarLimitError(f"JSON Schema grammar exceeds {self._max_rules} rules")
            rules.update(hit[1])
            return hit[0]
        if 1 + sum(map(len, distinct)) > TRIE_MAX_STATES:
            names_dfa(list(distinct))  # may be over the automaton limits: the same errors as there
        self._used.clear()
        # Open nodes along the previous name: [code point of the edge in, accepting, children].
        path: list[list[Any]] = [[-1, False, []]]
        prev = ""
        for word in distinct:
            p = 0
            m = min(len(word), len(prev))
            while p < m and word[p] == prev[p]:
                p += 1
            self._close(path, p, prev)
            path.extend([ord(ch), False, []] for ch in word[p:])
            path[-1][1] = True
            prev = word
        self._close(path, 0, prev)
        start = self._intern(path[0][1], path[0][2])
        if len(_TRIES) >= _MAX_TRIES:
            _TRIES.clear()
        _TRIES[distinct] = (start, tuple({ref.name: body for ref, body in self._used}.items()))
        return start

    def _close(self, path: list[list[Any]], depth: int, word: str) -> None:
        """Intern the open nodes below ``depth`` (``path`` spells ``word``), children first."""
        # Most of them are a chain: the word's last node (a leaf) and the nodes above it that end
        # no name and have no other child. Such a node depends only on the letters below it, so
        # the chain is interned as one piece by that suffix (process-wide, like the nodes).
        top = len(path) - 1
        j = top
        while j - 1 > depth and not path[j - 1][1] and not path[j - 1][2]:
            j -= 1
        if j < top:
            cp = path[j][0]
            del path[j:]
            path[-1][2].append((cp, self._chain(word[j:])))
        while len(path) > depth + 1:
            node = path.pop()
            path[-1][2].append((node[0], self._intern(node[1], node[2])))

    def _chain(self, suffix: str) -> Ref:
        """The node that spells ``suffix`` and then ends a name, with no other way on (interned)."""
        nodes = _CHAINS.get(suffix)
        if nodes is None:
            ref = self._intern(True, [])
            for ch in reversed(suffix):
                ref = self._intern(False, [(ord(ch), ref)])
            nodes = tuple(self._used[-len(suffix) - 1 :])
            if len(_CHAINS) >= _MAX_NODES:
                _CHAINS.clear()
            _CHAINS[suffix] = nodes
            return ref
        rules = self._rules
        for ref, body in nodes:
            if ref.name not in rules:
                if len(rules) >= self._max_rules:
                    raise GrammarLimitError(f"JSON Schema grammar exceeds {self._max_rules} rules")
                rules[ref.name] = body
        self._used.extend(nodes)
        return nodes[-1][0]

    def _intern(self, ends_name: bool, children: list[tuple[int, Ref]]) -> Ref:
        if len(children) == 1:  # most nodes: a name's letters past its last branching
            cp, child = children[0]
            key: tuple[object, ...] = (ends_name, cp, child.name)
        else:
            key = (ends_name, *[x for cp, ref in children for x in (cp, ref.name)])
        found = self._nodes.get(key)
        if found is None:
            hit = _NODES.get(key)
            if hit is None:
                if len(_NODES) >= _MAX_NODES:
                    _NODES.clear()
                hit = _NODES[key] = (
                    Ref(f"{KEY_RULE_PREFIX}{next(_NEXT_ID)}"),
                    _node_body(children, ends_name),
                )
            if len(self._rules) >= self._max_rules:
                raise GrammarLimitError(f"JSON Schema grammar exceeds {self._max_rules} rules")
            found = self._nodes[key] = hit
            self._rules[hit[0].name] = hit[1]
        self._used.append(found)
        return found[0]


# Child code points -> (the branch "a gap character, then the sink" or None, where it goes).
_GAPS: dict[tuple[int, ...], tuple[Expr | None, int]] = {}
# Code point -> special_head of it alone (the edge into a child; bounded by the names seen).
_CP_HEADS: dict[int, tuple[Expr, ...]] = {}


def _node_body(children: Sequence[tuple[int, Expr]], ends_name: bool) -> Expr:
    """:func:`complement_node` with :func:`special_head` edges and :data:`SINK_RULE` as the sink;
    the gap branch is one shared node per layout of child code points."""
    if len(children) == 1:
        cp, ref = children[0]
        one = _ONE_PLAIN_GAP.get(cp)
        if one is not None:
            # Most nodes: one plain child. The general path below, without its lookups and loop.
            edge = Seq((*_PLAIN_CP_HEADS[cp], ref))
            gap_seq, gap_at = one
            pair = [gap_seq, edge] if gap_at == 0 else [edge, gap_seq]
            if not ends_name:
                pair.append(_EMPTY)
            return Alt(tuple(pair))
    cps = tuple([cp for cp, _ in children])
    gap = _GAPS.get(cps)
    if gap is None:
        gaps, sink_at = code_point_gaps(cps)
        if len(_GAPS) >= _MAX_HEADS:
            _GAPS.clear()
        branch = Seq((*special_head(tuple(gaps)), _SINK_REF)) if gaps else None
        gap = _GAPS[cps] = (branch, sink_at)
    gap_branch, sink_at = gap
    branches: list[Expr] = []
    for k, (cp, ref) in enumerate(children):
        if k == sink_at and gap_branch is not None:
            branches.append(gap_branch)
        head = _PLAIN_CP_HEADS.get(cp) or _CP_HEADS.get(cp)
        if head is None:
            head = _CP_HEADS[cp] = special_head(((cp, cp),))
        branches.append(Seq((*head, ref)))
    if sink_at == len(children) and gap_branch is not None:
        branches.append(gap_branch)
    if not ends_name:
        branches.append(_EMPTY)
    return branches[0] if len(branches) == 1 else Alt(tuple(branches))


_EMPTY = Empty()


_SINK_EXPR = complement_sink(_SINK_REF, special_head)
SINK_EXPR = _SINK_EXPR
"""The body of :data:`SINK_RULE` (any rest of a key)."""

FREE_RULE = KEY_RULE_PREFIX + "free"
"""A special character (see :data:`SPECIAL_RULE`), then any rest of a key: the free branch of a
whole-trie rule (``keys/key_set.KeySet``) for the characters that need escapes or UTF-8
sequences, as one call that reads the whole rest of the key."""
FREE_EXPR: Expr = Seq((_SPECIAL_REF, _SINK_REF))


def node_body(children: Sequence[tuple[int, Expr]], ends_name: bool) -> Expr:
    """The rule body of a trie node: an edge per child (code point order) to its rule, the gaps
    between them to :data:`SINK_RULE`, and the end of the key unless the node ends a name."""
    return _node_body(children, ends_name)


def _one_plain_gap(cp: int) -> tuple[Expr, int]:
    gaps, sink_at = code_point_gaps((cp,))
    return Seq((*special_head(tuple(gaps)), _SINK_REF)), sink_at


# Library constants, like SPECIAL_EXPR (so not memos of earlier grammars, and never cleared): the
# edge into a child and the gap branch of a node whose only child is one plain printable character,
# the shape of most trie nodes. Built once at import (~1 ms) instead of again in every grammar.
_PLAIN_CHARS = [cp for lo, hi in _PLAIN for cp in range(lo, hi + 1)]
_PLAIN_CP_HEADS: dict[int, tuple[Expr, ...]] = {cp: special_head(((cp, cp),)) for cp in _PLAIN_CHARS}
_ONE_PLAIN_GAP: dict[int, tuple[Expr, int]] = {cp: _one_plain_gap(cp) for cp in _PLAIN_CHARS}

register_cache(_HEADS)
register_cache(_NODES)
register_cache(_TRIES)
register_cache(_CHAINS)
register_cache(_GAPS)
register_cache(_CP_HEADS)
