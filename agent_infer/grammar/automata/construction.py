"""Building code-point DFAs: from a decoded-string IR expression (Thompson NFA, then subset
construction over the ranges that actually occur), from a finite set of strings (their trie), and
the length counter."""

from __future__ import annotations

from agent_infer.errors import GrammarLimitError
from agent_infer.grammar.automata.dfa import DEFAULT_MAX_STATES, DFA, MAX_CP, Edge
from agent_infer.grammar.ir import Alt, CharClass, Empty, Expr, Literal, Ref, Repeat, Seq


class _NFA:
    def __init__(self, max_states: int) -> None:
        self.eps: list[list[int]] = []
        self.moves: list[list[tuple[tuple[tuple[int, int], ...], int]]] = []
        self.max_states = max_states

    def new(self) -> int:
        if len(self.eps) >= self.max_states:
            raise GrammarLimitError(f"string constraint automaton exceeds {self.max_states} states")
        self.eps.append([])
        self.moves.append([])
        return len(self.eps) - 1

    def build(self, e: Expr, s: int) -> int:
        """Add ``e`` starting at state ``s``; return its end state."""
        if isinstance(e, Empty):
            return s
        if isinstance(e, Literal):
            for c in e.text:
                t = self.new()
                self.moves[s].append((((ord(c), ord(c)),), t))
                s = t
            return s
        if isinstance(e, CharClass):
            t = self.new()
            self.moves[s].append((e.normalized(), t))
            return t
        if isinstance(e, Seq):
            for item in e.items:
                s = self.build(item, s)
            return s
        if isinstance(e, Alt):
            end = self.new()
            for item in e.items:
                start = self.new()
                self.eps[s].append(start)
                self.eps[self.build(item, start)].append(end)
            return end
        if isinstance(e, Repeat):
            for _ in range(e.min):
                s = self.build(e.item, s)
            if e.max is None:
                loop = self.new()
                self.eps[s].append(loop)
                self.eps[self.build(e.item, loop)].append(loop)
                return loop
            end = self.new()
            self.eps[s].append(end)
            for _ in range(e.max - e.min):
                s = self.build(e.item, s)
                self.eps[s].append(end)
            return end
        if isinstance(e, Ref):
            raise GrammarLimitError("string constraint refers to a rule; cannot build an automaton")
        raise TypeError(f"not an IR node: {e!r}")

    def closure(self, states: frozenset[int]) -> frozenset[int]:
        out = set(states)
        stack = list(states)
        while stack:
            for t in self.eps[stack.pop()]:
                if t not in out:
                    out.add(t)
                    stack.append(t)
        return frozenset(out)


def expr_to_dfa(e: Expr, max_states: int = DEFAULT_MAX_STATES, *, merge_equivalent: bool = True) -> DFA:
    """Determinize a decoded-string expression (no Refs). ``merge_equivalent=False`` gives the
    plain construction, one DFA state per distinct subset (the key trie of ``names_dfa`` is that,
    state for state); by default subsets that agree on their moving members and on acceptance are
    one state."""
    nfa = _NFA(max_states * 4)
    start = nfa.new()
    final = nfa.build(e, start)
    # Subset construction on bitsets. The code points split into the intervals between every
    # move's boundaries (the same for all states); per NFA state, which intervals it moves on
    # and the closure of where it goes, as one int, is worked out once. A DFA state's edges are
    # then ORs of those ints per interval: no per-state sweep, no frozenset per interval.
    cuts = sorted({p for moves in nfa.moves for rs, _ in moves for lo, hi in rs for p in (lo, hi + 1)})
    where = {p: j for j, p in enumerate(cuts)}
    n_cells = max(len(cuts) - 1, 0)
    closed: dict[int, int] = {}

    def closure_bits(s: int) -> int:
        bits = closed.get(s)
        if bits is None:
            bits = 0
            for t in nfa.closure(frozenset((s,))):
                bits |= 1 << t
            closed[s] = bits
        return bits

    moving = 0  # NFA states that have moves
    spans: list[list[tuple[int, int, int]]] = [[] for _ in nfa.moves]  # (first cell, end cell, target bits)
    for s, moves in enumerate(nfa.moves):
        for rs, t in moves:
            bits = closure_bits(t)
            for lo, hi in rs:
                spans[s].append((where[lo], where[hi + 1], bits))
            moving |= 1 << s
    final_bit = 1 << final
    # NFA states from which every string is accepted (a final `.*` loop, as a search pattern's
    # padding leaves): any subset holding one accepts everything, so all such subsets are one DFA
    # state. Without this, `.*(alpha|beta).*` keeps tracking partial matches after a full one
    # and the DFA grows by a factor of those combinations.
    universal = 0
    for s, moves in enumerate(nfa.moves if merge_equivalent else ()):
        # Only states with moves can loop; the closure of the others is not needed at all.
        if moves and closure_bits(s) & final_bit:
            for rs, t in moves:
                if rs == ((0, MAX_CP),) and closure_bits(t) >> s & 1:
                    universal |= 1 << s
    # A subset's future depends only on its members that move and on whether it holds the final
    # state: subsets that agree on those are one DFA state (the others are epsilon-only states
    # already expanded), so they are keyed by that part alone.
    keep = moving | final_bit if merge_equivalent else -1
    everything = closure_bits((universal & -universal).bit_length() - 1) & keep if universal else 0
    first = closure_bits(start)
    first = everything if first & universal else first & keep
    index = {first: 0}
    order = [first]
    edges: list[list[Edge]] = []
    accept: set[int] = set()
    i = 0
    while i < len(order):
        cur = order[i]
        if cur & final_bit:
            accept.add(i)
        cells = [0] * n_cells
        live = cur & moving
        while live:
            low = live & -live
            for a, b, bits in spans[low.bit_length() - 1]:
                for j in range(a, b):
                    cells[j] |= bits
            live ^= low
        out: list[Edge] = []
        for j, target_bits in enumerate(cells):
            if not target_bits:
                continue
            target_bits = everything if target_bits & universal else target_bits & keep
            target = index.get(target_bits)
            if target is None:
                if len(order) >= max_states:
                    raise GrammarLimitError(f"string constraint automaton exceeds {max_states} states")
                target = index[target_bits] = len(order)
                order.append(target_bits)
            if out and out[-1][2] == target and out[-1][1] + 1 == cuts[j]:
                out[-1] = (out[-1][0], cuts[j + 1] - 1, target)
            else:
                out.append((cuts[j], cuts[j + 1] - 1, target))
        edges.append(out)
        i += 1
    return DFA(edges, accept)


def dfa_length(min_len: int, max_len: int | None) -> DFA:
    """Strings of ``min_len`` to ``max_len`` code points."""
    n = max(min_len, 0) if max_len is None else max_len
    edges: list[list[Edge]] = [
        [(0, MAX_CP, min(i + 1, n))] if (max_len is None or i < n) else [] for i in range(n + 1)
    ]
    accept = {i for i in range(n + 1) if i >= min_len}
    return DFA(edges, accept)


def names_dfa(names: list[str]) -> DFA:
    """Exactly the given strings.

    The trie of the names, numbered breadth first with children in code point order: the DFA
    that determinizing ``alt(*map(lit, names))`` gives (each prefix is one subset of NFA states,
    met first from its parent), with its state limits and errors, without the subset construction.
    """
    distinct = list(dict.fromkeys(names))
    # NFA states that construction would allocate: the start, then for an alternation its end
    # and per branch a start plus one state per character; a single name only its characters.
    nfa_states = 1 + (
        sum(len(n) for n in distinct) if len(distinct) == 1 else 1 + sum(1 + len(n) for n in distinct)
    )
    nfa_limit = DEFAULT_MAX_STATES * 4
    if nfa_states > nfa_limit:
        raise GrammarLimitError(f"string constraint automaton exceeds {nfa_limit} states")
    # Each trie node: the names that pass through it, and its depth (the prefix length).
    order: list[list[str]] = [distinct]
    depth = [0]
    edges: list[list[Edge]] = []
    accept: set[int] = set()
    i = 0
    while i < len(order):
        group, d = order[i], depth[i]
        children: dict[str, list[str]] = {}
        for name in group:
            if len(name) == d:
                accept.add(i)
            else:
                children.setdefault(name[d], []).append(name)
        out: list[Edge] = []
        for ch in sorted(children):
            if len(order) >= DEFAULT_MAX_STATES:
                raise GrammarLimitError(f"string constraint automaton exceeds {DEFAULT_MAX_STATES} states")
            cp = ord(ch)
            out.append((cp, cp, len(order)))
            order.append(children[ch])
            depth.append(d + 1)
        edges.append(out)
        i += 1
    return DFA(edges, accept)
