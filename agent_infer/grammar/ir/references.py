"""Grammar validation: the first reference to an undefined rule (``Grammar.__post_init__``).

Big JSON Schema grammars hold ~10^5 nodes, and subtrees are shared within and between rules, so
the walk skips composite nodes it has met. The same walk exists in C++ (``_native.first_missing_ref``);
the IR does not load the extension itself: :mod:`agent_infer.grammar` installs a loader for it
(:func:`use_native_walk`), and the Python walk below runs when there is none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent_infer.grammar.ir.nodes import (
    Alt,
    BoundedString,
    CharClass,
    Check,
    Empty,
    Expr,
    KeyNode,
    KeySet,
    Literal,
    Ref,
    Repeat,
    Seq,
    UniqueItem,
)

_KINDS = (Empty, Literal, CharClass, Seq, Alt, Repeat, Ref)  # the order the native walk expects
# The native walk once resolved (False: none), or None before the first validation.
_native_walk: Any = None
_load_native_walk: Callable[[], Any] | None = None


def use_native_walk(load: Callable[[], Any]) -> None:
    """Validate with the walk ``load()`` returns (the native ``first_missing_ref``, or a false value
    for none), loaded at the first validation."""
    global _load_native_walk, _native_walk
    _load_native_walk = load
    _native_walk = None


def first_undefined_ref(rules: tuple[tuple[str, Expr], ...], names: set[str]) -> tuple[str, str] | None:
    """(rule name, missing name) of the first undefined reference, rules in order, each walked in
    pre-order with the last child first; None when every referenced rule is in ``names``."""
    found = _native_first(rules, names)
    if found is not None:
        return None if found[0] < 0 else (rules[found[0]][0], found[1])
    visited: set[int] = set()
    for name, expr in rules:
        try:
            _scan_refs(expr, names, visited)
        except _MissingRule as exc:
            return name, exc.name
        except RecursionError:
            missing = _undefined_ref(expr, names)  # deeper than the stack: the iterative walk
            if missing is not None:
                return name, missing
    return None


def _native_first(rules: tuple[tuple[str, Expr], ...], names: set[str]) -> tuple[int, str] | None:
    """The native walk: (rule index, missing name), (-1, "") when all are defined, None when the
    Python walk must decide (no native walk installed, foreign node types, key tries)."""
    global _native_walk
    if _native_walk is None:
        _native_walk = (_load_native_walk() if _load_native_walk is not None else False) or False
    if not _native_walk:
        return None
    found = _native_walk([expr for _, expr in rules], names, _KINDS)
    if found is None:
        return (-1, "")
    if found is False:
        return None
    return (int(found[0]), str(found[1]))


class _MissingRule(Exception):
    def __init__(self, name: str) -> None:
        self.name = name


def _scan_refs(node: Expr, names: set[str], visited: set[int]) -> bool:
    """Raise _MissingRule for the first undefined reference (the order of :func:`_undefined_ref`:
    pre-order, last child first); return whether the subtree holds no Ref at all.

    ``visited`` holds composite nodes already scanned in this grammar (without finding a missing
    name, or the scan would have stopped); Ref-free ones are marked on the node for good.
    """
    kind = type(node)
    if kind is Ref:
        if node.name not in names:  # type: ignore[attr-defined]
            raise _MissingRule(node.name)  # type: ignore[attr-defined]
        return False
    if kind is Literal or kind is CharClass or kind is Empty:
        return True
    if kind is Seq or kind is Alt or kind is Repeat:
        if node._ref_free:
            return True
        key = id(node)
        if key in visited:
            return False
        visited.add(key)
        free = True
        children = node.items if kind is not Repeat else (node.item,)  # type: ignore[attr-defined]
        for i in range(len(children) - 1, -1, -1):
            if not _scan_refs(children[i], names, visited):
                free = False
        if free:
            object.__setattr__(node, "_ref_free", True)
        return free
    missing = _undefined_ref(node, names)  # subclasses and foreign nodes: the general walk
    if missing is not None:
        raise _MissingRule(missing)
    return False


def _undefined_ref(expr: Expr, names: set[str], visited: set[int] | None = None) -> str | None:
    """The first referenced rule name not in ``names`` (a tight loop: big schemas have ~10^5 nodes).

    ``visited`` holds ids of composite nodes whose subtrees were already searched (depth first, so
    a node met again was searched completely before); they are skipped, which keeps the first
    missing name the same as a plain tree walk would find.
    """
    if visited is None:
        visited = set()
    stack = [expr]
    pop, push, extend, mark = stack.pop, stack.append, stack.extend, visited.add
    while stack:
        node = pop()
        kind = type(node)
        if kind is Ref:
            if node.name not in names:  # type: ignore[attr-defined]
                return node.name  # type: ignore[attr-defined]
        elif kind is Seq or kind is Alt:
            if id(node) not in visited:
                mark(id(node))
                extend(node.items)  # type: ignore[attr-defined]
        elif kind is Repeat:
            if id(node) not in visited:
                mark(id(node))
                push(node.item)  # type: ignore[attr-defined]
        elif kind is Literal or kind is CharClass or kind is Empty:
            continue
        elif isinstance(node, Ref):
            if node.name not in names:
                return node.name
        elif isinstance(node, Seq | Alt):
            extend(node.items)
        elif isinstance(node, Repeat):
            push(node.item)
        elif isinstance(node, KeySet | KeyNode):
            extend(node.expand())  # the rules its expansion calls
        elif isinstance(node, Check):
            extend(node.items)
        elif isinstance(node, UniqueItem | BoundedString):
            push(node.item)
    return None
