"""IR grammars to the flat per-rule integer programs the native compiler lowers (grammar/ir/program.h, enum Op).

One serializer, the native one (engine_native/src/grammar/ir/serialize.cpp): it walks the IR in C++
and dispatches on the exact node kinds of :data:`~agent_infer.grammar.ir.NODE_KINDS`, writing
a :class:`~agent_infer.grammar.ir.KeySet` rule as one ``KEY_TRIE`` instruction and a
:class:`~agent_infer.grammar.ir.KeyNode` from its spec. It declines (returns None) anything it
does not take as is: a subclass of a node kind or a foreign object, a nested ``KeySet``, a
literal with a lone surrogate, an undefined rule name, repeat bounds beyond int32, a
:class:`~agent_infer.grammar.ir.UniqueItem` or :class:`~agent_infer.grammar.ir.BoundedString` that
is not a whole rule body (written as a ``UNIQUE`` word, or ``MAX_LENGTH n``, before its item's
program). For those,
:func:`_declared` rebuilds the grammar from exact node kinds (a nested key trie as its
expansion), raising the precise error for what cannot be compiled, and the native serializer
runs again.
"""

from __future__ import annotations

import hashlib
from typing import Any

from agent_infer.errors import GrammarDefinitionError, GrammarLimitError
from agent_infer.grammar.ir import (
    NODE_KINDS,
    Alt,
    BoundedString,
    CharClass,
    Check,
    Empty,
    Expr,
    Grammar,
    KeyNode,
    KeySet,
    Literal,
    Ref,
    Repeat,
    Seq,
    UniqueItem,
)
from agent_infer.native import require_native

_INT32_MAX = 2**31 - 1
_PLAIN_KEY_CHARS = frozenset(chr(c) for c in range(0x20, 0x7F)) - {'"', "/", "\\"}


def serialize_grammar(grammar: Grammar) -> tuple[list[list[int]], int]:
    """The rule programs as Python lists, and the root's rule index (for inspection and tests;
    :func:`serialize_for_compile` is what the compiler uses)."""
    index = {name: i for i, (name, _) in enumerate(grammar.rules)}
    native: Any = require_native("grammar serialization", "serialize_rules")
    programs = native([expr for _, expr in grammar.rules], index, NODE_KINDS)
    if programs is None:
        programs = native([expr for _, expr in _declared(grammar, index).rules], index, NODE_KINDS)
        if programs is None:
            raise GrammarDefinitionError("the native serializer declined a grammar of declared node kinds")
    return programs, index[grammar.root]


def serialize_for_compile(grammar: Grammar) -> tuple[Any, int]:
    """The rule programs as native ``SerializedRules`` (never converted to Python ints), and the
    root's rule index: what ``compile_serialized`` takes.

    A front end may name rules whose bodies it shares across grammars (``_shared_prefix``): their
    programs are then cached natively by body object. The native side builds the rule index from
    the pairs, and takes the IR it walks out of the cyclic GC (IR trees hold no cycles), so the
    first collection after this compile does not walk the whole grammar.
    """
    packed: Any = require_native("grammar serialization", "serialize_grammar_packed")
    found = packed(grammar.rules, grammar.root, NODE_KINDS, getattr(grammar, "_shared_prefix", None))
    if found is None:
        index = {name: i for i, (name, _) in enumerate(grammar.rules)}
        found = packed(_declared(grammar, index).rules, grammar.root, NODE_KINDS, None)
        if found is None:
            raise GrammarDefinitionError("the native serializer declined a grammar of declared node kinds")
    return found[0], found[1]


def program_key(grammar: Grammar, programs: Any, root: int) -> str:
    """The compile-cache key: a digest of the rule names and programs, which determine the automata.

    Hashing the programs the compile needs anyway costs a few ms for a 3 000-rule schema where
    printing the grammar for :meth:`Grammar.fingerprint` took ~30 ms. Grammars with equal keys
    print alike, up to how a character class is written (``[^...]`` or its ranges).
    """
    digest = hashlib.sha256()
    digest.update(f"{root}\n{len(grammar.rules)}\n".encode())
    digest.update("\x00".join(name for name, _ in grammar.rules).encode())
    digest.update(bytes(programs.tobytes()))
    return digest.hexdigest()


def _declared(grammar: Grammar, index: dict[str, int]) -> Grammar:
    """``grammar`` rebuilt from exact node kinds with plain field values, or the error that says why
    a node cannot be compiled (the first in rule order, each rule in pre-order)."""
    memo: dict[int, tuple[Expr, Expr]] = {}
    rules = tuple((name, _declared_expr(name, expr, index, memo)) for name, expr in grammar.rules)
    return Grammar.unchecked(rules, grammar.root, grammar.warnings)


def _declared_expr(rule: str, expr: Expr, index: dict[str, int], memo: dict[int, tuple[Expr, Expr]]) -> Expr:
    """One rule body rebuilt (see :func:`_declared`); iterative, so any nesting depth works.
    ``memo`` maps the id of each composite node already rebuilt to (the node, its copy): shared
    subtrees stay shared, and holding the node keeps its id from being reused meanwhile."""
    if type(expr) is KeySet:  # only as a whole rule body
        _check_key_set(rule, expr, index)
        return expr
    if type(expr) is Check:  # only as a whole rule body
        for item in expr.items:
            if item.name not in index:
                raise GrammarDefinitionError(f"rule {rule!r} refers to undefined rule {item.name!r}")
        return Check(
            tuple(Ref(str(r.name)) for r in expr.items),
            int(expr.carriers),
            tuple(expr.accept),
            bool(expr.product),
        )
    if isinstance(expr, UniqueItem):  # likewise
        return UniqueItem(_declared_expr(rule, expr.item, index, memo))
    if isinstance(expr, BoundedString):  # likewise
        if expr.max_length > _INT32_MAX:
            raise GrammarLimitError(f"a bounded string's length {expr.max_length} is too large")
        return BoundedString(_declared_expr(rule, expr.item, index, memo), int(expr.max_length))
    # Work items: (node, None) visits a node; (node, kids) builds it from its last kids results.
    done: list[Expr] = []
    todo: list[tuple[Any, int | None]] = [(expr, None)]
    while todo:
        node, kids = todo.pop()
        if kids is not None:
            built = done[len(done) - kids :]
            del done[len(done) - kids :]
            if isinstance(node, Repeat):
                copy: Expr = Repeat(built[0], int(node.min), None if node.max is None else int(node.max))
            else:
                copy = (Seq if isinstance(node, Seq) else Alt)(tuple(built))
            memo[id(node)] = (node, copy)
            done.append(copy)
            continue
        hit = memo.get(id(node))
        if hit is not None:
            done.append(hit[1])
        elif isinstance(node, Check):
            raise GrammarDefinitionError(f"rule {rule!r}: a Check is only allowed as a rule's whole body")
        elif isinstance(node, KeySet | KeyNode):
            # Nested (or a node whose rules are missing): the alternation it expands to.
            todo.append((Alt(node.expand()), None))
        elif isinstance(node, Literal):
            try:
                node.text.encode("utf-8")
            except UnicodeEncodeError:
                raise GrammarDefinitionError(
                    f"literal {node.text!r} contains a lone surrogate, which has no UTF-8 encoding"
                ) from None
            done.append(Literal(str(node.text)))
        elif isinstance(node, CharClass):
            done.append(CharClass(tuple((int(lo), int(hi)) for lo, hi in node.ranges), bool(node.negated)))
        elif isinstance(node, Ref):
            if node.name not in index:
                raise GrammarDefinitionError(f"rule {rule!r} refers to undefined rule {node.name!r}")
            done.append(Ref(str(node.name)))
        elif isinstance(node, Empty):
            done.append(Empty())
        elif isinstance(node, Repeat):
            if node.min > _INT32_MAX or (node.max is not None and node.max > _INT32_MAX):
                raise GrammarLimitError(f"repeat bounds {{{node.min},{node.max}}} are too large")
            todo.append((node, 1))
            todo.append((node.item, None))
        elif isinstance(node, Seq | Alt):
            items = tuple(node.items)
            todo.append((node, len(items)))
            todo.extend((item, None) for item in reversed(items))
        elif isinstance(node, UniqueItem | BoundedString):
            raise GrammarDefinitionError(
                f"rule {rule!r}: a {type(node).__name__} is only allowed as a whole rule body"
            )
        else:
            raise GrammarDefinitionError(f"not an IR node: {node!r}")
    return done[0]


def _check_key_set(rule: str, node: KeySet, index: dict[str, int]) -> None:
    for called in (KeySet.FREE_RULE, KeySet.REST_RULE):
        if called not in index:
            raise GrammarDefinitionError(f"rule {rule!r} refers to undefined rule {called!r}")
    names = node.names
    if not all(type(n) is str and set(n) <= _PLAIN_KEY_CHARS for n in names) or list(names) != sorted(
        set(names)
    ):
        raise GrammarDefinitionError(
            f"rule {rule!r}: a KeySet holds sorted, distinct names of plain printable ASCII, got {names!r}"
        )
