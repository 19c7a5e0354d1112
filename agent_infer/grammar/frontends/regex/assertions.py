"""Zero-width assertions inside a pattern: lookaheads ``(?=X)``/``(?!X)`` and anchors away from the
pattern's edges (``^(a|$)``, ``(x$|y)z``). A regular expression with them still has a regular
language: it is built here as an automaton and written back as an IR expression.

The pattern becomes an NFA whose empty moves may carry a condition: ``^`` only at offset 0, ``$``
only at the end, a lookahead spawns an *obligation* on the rest of the input. Determinizing
tracks, per configuration, the NFA state and the pending obligations (each a set of states of its
lookahead's own NFA): a positive one is met once its body matched, a negative one kills the
configuration when its body matches; at the end of the input, the body may still match by its own
``$``. The DFA is turned back into an expression by state elimination. Lookaheads inside
lookaheads, and lookbehinds, stay unsupported; so do automata past :data:`MAX_ASSERTION_STATES`
states while determinizing or :data:`MAX_ELIMINATED_STATES` once minimal enough to eliminate, and
expressions past :data:`MAX_EXPRESSION_NODES` nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from agent_infer.errors import UnsupportedRegexError
from agent_infer.grammar.ir import (
    MAX_CODEPOINT,
    Alt,
    CharClass,
    Empty,
    Expr,
    Literal,
    Repeat,
    Seq,
    alt,
    seq,
    star,
)

MAX_ASSERTION_STATES = 4000
MAX_ELIMINATED_STATES = 600
MAX_EXPRESSION_NODES = 60_000

_START, _END = -1, -2  # conditions of empty moves (a lookahead's is its index, >= 0)


@dataclass(frozen=True)
class _Look(Expr):
    """Parse-time node for a lookahead: the rest of the input must (not) start with ``body``."""

    positive: bool
    body: Expr
    pos: int

    def children(self) -> tuple[Expr, ...]:
        return (self.body,)


def first_lookahead(expr: Expr) -> _Look | None:
    """The first lookahead in ``expr`` (pre-order), if any."""
    if isinstance(expr, _Look):
        return expr
    for child in expr.children():
        found = first_lookahead(child)
        if found is not None:
            return found
    return None


def has_assertions(expr: Expr, at_start: bool = True, at_end: bool = True) -> bool:
    """Whether ``expr`` holds a lookahead or an anchor away from its edges (which the plain path
    of the regex front end, stripping edge anchors, cannot express)."""
    from agent_infer.grammar.frontends.regex.escapes import _Anchor

    if isinstance(expr, _Look):
        return True
    if isinstance(expr, _Anchor):
        return not ((expr.start and at_start) or (not expr.start and at_end))
    if isinstance(expr, Alt):
        return any(has_assertions(e, at_start, at_end) for e in expr.items)
    if isinstance(expr, Seq):
        items = expr.items
        for k, item in enumerate(items):
            before = all(isinstance(e, _Anchor) for e in items[:k])
            after = all(isinstance(e, _Anchor) for e in items[k + 1 :])
            if has_assertions(item, at_start and before, at_end and after):
                return True
        return False
    if isinstance(expr, Repeat):
        return has_assertions(expr.item, False, False)
    return False


class _Nfa:
    """States with code point edges ``(lo, hi, target)`` and empty moves ``(condition, target)``."""

    def __init__(self) -> None:
        self.chars: list[list[tuple[int, int, int]]] = []
        self.moves: list[list[tuple[int | None, int]]] = []
        self.looks: list[tuple[bool, int, int]] = []  # (positive, body start, body end)

    def state(self) -> int:
        self.chars.append([])
        self.moves.append([])
        return len(self.chars) - 1

    def build(self, expr: Expr, start: int, end: int, in_look: bool) -> None:
        """Connect ``start`` to ``end`` through ``expr``."""
        from agent_infer.grammar.frontends.regex.escapes import _Anchor

        if isinstance(expr, Empty):
            self.moves[start].append((None, end))
        elif isinstance(expr, Literal):
            cur = start
            for k, ch in enumerate(expr.text):
                nxt = end if k == len(expr.text) - 1 else self.state()
                self.chars[cur].append((ord(ch), ord(ch), nxt))
                cur = nxt
        elif isinstance(expr, CharClass):
            for lo, hi in expr.normalized():
                self.chars[start].append((lo, hi, end))
        elif isinstance(expr, Seq):
            cur = start
            for k, item in enumerate(expr.items):
                nxt = end if k == len(expr.items) - 1 else self.state()
                self.build(item, cur, nxt, in_look)
                cur = nxt
            if not expr.items:
                self.moves[start].append((None, end))
        elif isinstance(expr, Alt):
            for item in expr.items:
                self.build(item, start, end, in_look)
        elif isinstance(expr, Repeat):
            cur = start
            for _ in range(expr.min):
                nxt = self.state()
                self.build(expr.item, cur, nxt, in_look)
                cur = nxt
            if expr.max is None:
                loop = self.state()
                self.moves[cur].append((None, loop))
                back = self.state()
                self.build(expr.item, loop, back, in_look)
                self.moves[back].append((None, loop))
                self.moves[loop].append((None, end))
            else:
                for _ in range(expr.max - expr.min):
                    self.moves[cur].append((None, end))
                    nxt = self.state()
                    self.build(expr.item, cur, nxt, in_look)
                    cur = nxt
                self.moves[cur].append((None, end))
        elif isinstance(expr, _Anchor):
            self.moves[start].append((_START if expr.start else _END, end))
        elif isinstance(expr, _Look):
            if in_look:
                raise UnsupportedRegexError(
                    "a lookahead inside a lookahead is not supported", position=expr.pos
                )
            body_start, body_end = self.state(), self.state()
            self.build(expr.body, body_start, body_end, True)
            self.looks.append((expr.positive, body_start, body_end))
            self.moves[start].append((len(self.looks) - 1, end))
        else:
            raise TypeError(f"not a regex node: {expr!r}")


_Obligation = tuple[int, frozenset[int]]  # (lookahead, its body's states)
_Config = tuple[int, tuple[_Obligation, ...]]


class _Determinizer:
    def __init__(self, nfa: _Nfa, accept: int) -> None:
        self.nfa = nfa
        self.accept = accept

    def states_closure(self, states: set[int], at_start: bool, at_end: bool) -> set[int]:
        """Empty moves within one lookahead body (no lookaheads there)."""
        out, todo = set(states), list(states)
        while todo:
            s = todo.pop()
            for cond, t in self.nfa.moves[s]:
                ok = cond is None or (cond == _START and at_start) or (cond == _END and at_end)
                if ok and t not in out:
                    out.add(t)
                    todo.append(t)
        return out

    def obligation(self, look: int, states: set[int], at_start: bool) -> _Obligation | bool:
        """The obligation after its body's states moved (closed): True when met, False when it
        fails, else the pending obligation."""
        positive, _, body_end = self.nfa.looks[look]
        closed = frozenset(self.states_closure(states, at_start, False))
        if body_end in closed:
            return positive
        if not any(self.nfa.chars[s] for s in closed) and body_end not in self.states_closure(
            set(closed), at_start, True
        ):
            return not positive  # its body can match no more: decided
        return (look, closed)

    def closure(self, configs: set[_Config], at_start: bool) -> set[_Config]:
        """Empty moves of the main automaton (``$`` left for the end of the input)."""
        out, todo = set(configs), list(configs)
        while todo:
            state, pending = todo.pop()
            for cond, t in self.nfa.moves[state]:
                if cond == _END or (cond == _START and not at_start):
                    continue
                obligations = pending
                if cond is not None and cond >= 0:
                    _, body_start, _ = self.nfa.looks[cond]
                    found = self.obligation(cond, {body_start}, at_start)
                    if found is False:
                        continue
                    if found is not True:
                        obligations = tuple(sorted({*pending, found}))
                config = (t, obligations)
                if config not in out:
                    out.add(config)
                    todo.append(config)
        return out

    def accepts(self, configs: frozenset[_Config], at_start: bool) -> bool:
        """Whether the input may end here: the accept state reached through empty moves (``$``
        allowed, a lookahead met by its body reaching its end the same way) with every pending
        obligation met likewise."""
        for state, pending in configs:
            if not all(self._met_at_end(look, states, at_start) for look, states in pending):
                continue
            seen, todo = {state}, [state]
            while todo:
                s = todo.pop()
                if s == self.accept:
                    return True
                for cond, t in self.nfa.moves[s]:
                    ok = cond is None or cond == _END or (cond == _START and at_start)
                    if cond is not None and cond >= 0:
                        _, body_start, _ = self.nfa.looks[cond]
                        ok = self._met_at_end(cond, frozenset({body_start}), at_start)
                    if ok and t not in seen:
                        seen.add(t)
                        todo.append(t)
        return False

    def _met_at_end(self, look: int, states: frozenset[int], at_start: bool) -> bool:
        positive, _, body_end = self.nfa.looks[look]
        return (body_end in self.states_closure(set(states), at_start, True)) == positive

    def step(self, configs: frozenset[_Config], lo: int, hi: int) -> frozenset[_Config]:
        """The configurations after one code point in [lo, hi] (every point there moves alike)."""
        out: set[_Config] = set()
        for state, pending in configs:
            targets = [t for a, b, t in self.nfa.chars[state] if a <= lo and hi <= b]
            if not targets:
                continue
            moved: list[_Obligation] = []
            dead = False
            for look, states in pending:
                nxt = {t for s in states for a, b, t in self.nfa.chars[s] if a <= lo and hi <= b}
                found = self.obligation(look, nxt, False)
                if found is False:
                    dead = True
                    break
                if found is not True:
                    moved.append(found)
            if dead:
                continue
            obligations = tuple(sorted(set(moved)))
            out.update((t, obligations) for t in targets)
        return frozenset(self.closure(out, False))

    def boundaries(self, configs: frozenset[_Config]) -> list[tuple[int, int]]:
        """The code point ranges on which every edge leaving ``configs`` agrees."""
        cuts = {0, MAX_CODEPOINT + 1}
        for state, pending in configs:
            edges = list(self.nfa.chars[state])
            for _, states in pending:
                for s in states:
                    edges.extend(self.nfa.chars[s])
            for lo, hi, _ in edges:
                cuts.add(lo)
                cuts.add(hi + 1)
        points = sorted(cuts)
        return [(points[k], points[k + 1] - 1) for k in range(len(points) - 1)]


def assertion_dfa(expr: Expr, search: bool) -> tuple[list[list[tuple[int, int, int]]], set[int]]:
    """The DFA (edges per state, accepting states; state 0 starts) of strings matching ``expr``
    (``search``: containing a match, JSON Schema's ``pattern``), assertions included."""
    nfa = _Nfa()
    start, accept = nfa.state(), nfa.state()
    if search:
        # ^ and $ are offsets of the whole input, so the padding may consume text around a match.
        pre, post = nfa.state(), nfa.state()
        nfa.chars[start].append((0, MAX_CODEPOINT, start))
        nfa.moves[start].append((None, pre))
        nfa.build(expr, pre, post, False)
        nfa.chars[post].append((0, MAX_CODEPOINT, post))
        nfa.moves[post].append((None, accept))
    else:
        nfa.build(expr, start, accept, False)
    det = _Determinizer(nfa, accept)
    first = frozenset(det.closure({(start, ())}, True))
    index = {first: 0}
    order = [first]
    edges: list[list[tuple[int, int, int]]] = []
    accepting: set[int] = set()
    k = 0
    while k < len(order):
        configs = order[k]
        if det.accepts(configs, k == 0):
            accepting.add(k)
        out: list[tuple[int, int, int]] = []
        for lo, hi in det.boundaries(configs):
            nxt = det.step(configs, lo, hi)
            if not nxt:
                continue
            if nxt not in index:
                if len(order) >= MAX_ASSERTION_STATES:
                    raise UnsupportedRegexError(
                        f"the lookaheads or inner anchors need more than {MAX_ASSERTION_STATES} automaton states",
                        position=0,
                    )
                index[nxt] = len(order)
                order.append(nxt)
            t = index[nxt]
            if out and out[-1][2] == t and out[-1][1] + 1 == lo:
                out[-1] = (out[-1][0], hi, t)
            else:
                out.append((lo, hi, t))
        edges.append(out)
        k += 1
    return edges, accepting


def dfa_expression(edges: list[list[tuple[int, int, int]]], accepting: set[int]) -> Expr:
    """An expression of the DFA's language, by state elimination (states with the fewest paths
    through them first). UnsupportedRegexError past :data:`MAX_EXPRESSION_NODES` nodes."""
    n = len(edges)
    if n > MAX_ELIMINATED_STATES:
        raise UnsupportedRegexError(
            f"the lookaheads or inner anchors need {n} automaton states, more than {MAX_ELIMINATED_STATES}",
            position=0,
        )
    sizes: dict[int, int] = {}

    def nodes(e: Expr) -> int:
        found = sizes.get(id(e))
        if found is None:
            found = sizes[id(e)] = (
                1 + sum(nodes(c) for c in e.children()) if isinstance(e, Seq | Alt | Repeat) else 1
            )
        return found

    start, final = n, n + 1
    arcs: dict[int, dict[int, Expr]] = {s: {} for s in range(n + 2)}

    def add(p: int, q: int, e: Expr) -> None:
        arcs[p][q] = alt(arcs[p][q], e) if q in arcs[p] else e

    for s, out in enumerate(edges):
        by_target: dict[int, list[tuple[int, int]]] = {}
        for lo, hi, t in out:
            by_target.setdefault(t, []).append((lo, hi))
        for t, ranges in by_target.items():
            add(s, t, CharClass(tuple(ranges)))
    add(start, 0, Empty())
    for s in accepting:
        add(s, final, Empty())
    live = _co_reachable(arcs, final)
    remaining = [s for s in range(n) if s in live]
    for s in range(n):
        if s not in live:
            for p in arcs:
                arcs[p].pop(s, None)
            arcs[s] = {}
    size = 0
    while remaining:
        incoming = {s: [p for p in arcs if s in arcs[p] and p != s] for s in remaining}
        k = min(remaining, key=lambda s: len(incoming[s]) * len(arcs[s]))
        remaining.remove(k)
        loop = arcs[k].pop(k, None)
        middle = star(loop) if loop is not None else Empty()
        for p in incoming[k]:
            head = arcs[p].pop(k)
            for q, tail in arcs[k].items():
                path = seq(head, middle, tail)
                size += nodes(path)
                if size > MAX_EXPRESSION_NODES:
                    raise UnsupportedRegexError(
                        f"the lookaheads or inner anchors give an expression of more than {MAX_EXPRESSION_NODES} nodes",
                        position=0,
                    )
                add(p, q, path)
        arcs[k] = {}
    return arcs[start].get(final, Alt(()))


def _co_reachable(arcs: dict[int, dict[int, Expr]], final: int) -> set[int]:
    back: dict[int, set[int]] = {}
    for p, out in arcs.items():
        for q in out:
            back.setdefault(q, set()).add(p)
    seen, todo = {final}, [final]
    while todo:
        for p in back.get(todo.pop(), ()):
            if p not in seen:
                seen.add(p)
                todo.append(p)
    return seen


def minimized(
    edges: list[list[tuple[int, int, int]]], accepting: set[int]
) -> tuple[list[list[tuple[int, int, int]]], set[int]]:
    """The same DFA with equivalent states merged (partition refinement; state 0 stays first)."""
    block = [1 if s in accepting else 0 for s in range(len(edges))]
    while True:
        signatures: dict[tuple[object, ...], int] = {}
        nxt = []
        for s, out in enumerate(edges):
            merged: list[tuple[int, int, int]] = []
            for lo, hi, t in out:
                b = block[t]
                if merged and merged[-1][2] == b and merged[-1][1] + 1 == lo:
                    merged[-1] = (merged[-1][0], hi, b)
                else:
                    merged.append((lo, hi, b))
            nxt.append(signatures.setdefault((block[s], tuple(merged)), len(signatures)))
        if len(signatures) == len(set(block)):
            break
        block = nxt
    order: dict[int, int] = {}
    for s in range(len(edges)):
        order.setdefault(block[s], len(order))
    out_edges: list[list[tuple[int, int, int]]] = [[] for _ in order]
    for s, out in enumerate(edges):
        b = order[block[s]]
        if out_edges[b] or not out:
            continue
        for lo, hi, t in out:
            tb = order[block[t]]
            if out_edges[b] and out_edges[b][-1][2] == tb and out_edges[b][-1][1] + 1 == lo:
                out_edges[b][-1] = (out_edges[b][-1][0], hi, tb)
            else:
                out_edges[b].append((lo, hi, tb))
    return out_edges, {order[block[s]] for s in accepting}


def assertion_expr(expr: Expr, search: bool) -> Expr:
    """``expr`` (with lookaheads or inner anchors) as a plain expression of the same language."""
    edges, accepting = minimized(*assertion_dfa(expr, search))
    return dfa_expression(edges, accepting)
