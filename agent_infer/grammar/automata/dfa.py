"""Small DFAs over code-point ranges, for string constraints that a CFG cannot combine directly.

``pattern`` + ``minLength``, two patterns in ``allOf``, property keys "matching P but not a declared
name": each needs intersection or complement of regular languages, which the IR (a CFG) has no
operator for. We build DFAs from decoded-string expressions (subset construction over the ranges
that actually occur), combine them, and emit the result as right-linear IR rules whose edges are
JSON-encoded (:func:`encode_class`). Every step is bounded by ``max_states``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from agent_infer.errors import GrammarLimitError
from agent_infer.grammar.compile.caches import register_cache
from agent_infer.grammar.frontends.json_schema.text import MAX_CP, encode_class
from agent_infer.grammar.ir import Alt, CharClass, Empty, Expr, Literal, Ref, Repeat, Seq

Edge = tuple[int, int, int]  # lo, hi, target


@dataclass
class DFA:
    """Deterministic automaton: ``edges[s]`` are disjoint (lo, hi, target) ranges; start is 0."""

    edges: list[list[Edge]]
    accept: set[int]
    # _live's answer, kept: emptiness tests and rule emission both need it (DFAs are not mutated).
    live: set[int] | None = field(default=None, compare=False, repr=False)


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


_DEFAULT_MAX_STATES = 4000
TRIE_MAX_STATES = _DEFAULT_MAX_STATES  # names_dfa's limit on trie nodes


def expr_to_dfa(e: Expr, max_states: int = _DEFAULT_MAX_STATES, *, merge_equivalent: bool = True) -> DFA:
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


def new_product_state(
    pair: tuple[int, int], index: dict[tuple[int, int], int], order: list[tuple[int, int]], max_states: int
) -> int:
    """Number a product state first met as ``pair`` (within ``max_states``, else GrammarLimitError)."""
    if len(order) >= max_states:
        raise GrammarLimitError(f"string constraint automaton exceeds {max_states} states")
    index[pair] = len(order)
    order.append(pair)
    return index[pair]


def _merge(edges: list[Edge]) -> list[Edge]:
    edges.sort()
    out: list[Edge] = []
    for lo, hi, t in edges:
        if out and out[-1][2] == t and out[-1][1] + 1 == lo:
            out[-1] = (out[-1][0], hi, t)
        else:
            out.append((lo, hi, t))
    return out


def dfa_intersect(a: DFA, b: DFA, max_states: int = 4000) -> DFA:
    """Product automaton accepting strings of both."""
    index = {(0, 0): 0}
    order = [(0, 0)]
    edges: list[list[Edge]] = []
    accept: set[int] = set()
    i = 0
    while i < len(order):
        x, y = order[i]
        if x in a.accept and y in b.accept:
            accept.add(i)
        out: list[Edge] = []
        # Every DFA here keeps its edges sorted and disjoint, so the b-edges meeting an a-edge are
        # one run, found by a pointer that only moves forward. Pairs come in the same order as a
        # nested loop over both lists (a-major), so new states get the same numbers.
        eb = b.edges[y]
        nb = len(eb)
        j0 = 0
        for lo1, hi1, t1 in a.edges[x]:
            while j0 < nb and eb[j0][1] < lo1:
                j0 += 1
            j = j0
            while j < nb and eb[j][0] <= hi1:
                lo2, hi2, t2 = eb[j]
                j += 1
                pair = (t1, t2)
                target = index.get(pair)
                if target is None:
                    target = new_product_state(pair, index, order, max_states)
                out.append((lo1 if lo1 > lo2 else lo2, hi1 if hi1 < hi2 else hi2, target))
        edges.append(_merge(out))
        i += 1
    return DFA(edges, accept)


def dfa_complement(a: DFA) -> DFA:
    """Strings (over all code points) that ``a`` rejects."""
    sink = len(a.edges)
    edges: list[list[Edge]] = []
    for out in [*a.edges, []]:
        full: list[Edge] = []
        nxt = 0
        for lo, hi, t in sorted(out):
            if lo > nxt:
                full.append((nxt, lo - 1, sink))
            full.append((lo, hi, t))
            nxt = hi + 1
        if nxt <= MAX_CP:
            full.append((nxt, MAX_CP, sink))
        edges.append(full)
    return DFA(edges, set(range(len(edges))) - a.accept)


def dfa_universal(a: DFA) -> set[int]:
    """States from which every continuation (over all code points) is accepted."""

    def covers_all(out: list[Edge]) -> bool:
        nxt = 0
        for lo, hi, _ in out:
            if lo > nxt:
                return False
            nxt = hi + 1
        return nxt > MAX_CP

    found = {s for s in a.accept if covers_all(a.edges[s])}
    changed = True
    while changed:
        changed = False
        for s in list(found):
            if any(t not in found for _, _, t in a.edges[s]):
                found.discard(s)
                changed = True
    return found


def dfa_includes(a: DFA, b: DFA, max_pairs: int = 4000) -> bool | None:
    """Whether every string ``a`` accepts is one ``b`` accepts; None when deciding it would walk
    more than ``max_pairs`` state pairs (callers then keep both constraints)."""
    live_a = _live(a)
    if 0 not in live_a:
        return True
    # A pair whose b side accepts every continuation can never show a counterexample, so the walk
    # stops there: a format under a pattern like ``^.*@.*$`` costs only the states before the `@`.
    universal_b = dfa_universal(b)
    seen = {(0, 0)}
    stack = [(0, 0)]
    while stack:
        x, y = stack.pop()
        if y in universal_b:
            continue
        if x in a.accept and y not in b.accept:
            return False
        eb = b.edges[y]
        nb = len(eb)
        j0 = 0
        for lo1, hi1, t1 in a.edges[x]:
            if t1 not in live_a:
                continue
            while j0 < nb and eb[j0][1] < lo1:
                j0 += 1
            pos = lo1
            j = j0
            while j < nb and eb[j][0] <= hi1:
                lo2, hi2, t2 = eb[j]
                if lo2 > pos:
                    return False  # a reads a code point b has no move on, and can still accept
                pair = (t1, t2)
                if pair not in seen:
                    if len(seen) >= max_pairs:
                        return None
                    seen.add(pair)
                    stack.append(pair)
                pos = hi2 + 1
                if pos > hi1:
                    break
                j += 1
            if pos <= hi1:
                return False
    return True


def dfa_length(min_len: int, max_len: int | None) -> DFA:
    """Strings of ``min_len`` to ``max_len`` code points."""
    n = max(min_len, 0) if max_len is None else max_len
    edges: list[list[Edge]] = [
        [(0, MAX_CP, min(i + 1, n))] if (max_len is None or i < n) else [] for i in range(n + 1)
    ]
    accept = {i for i in range(n + 1) if i >= min_len}
    return DFA(edges, accept)


def dfa_is_empty(a: DFA) -> bool:
    """True if no string is accepted."""
    return not _live(a)


def _live(a: DFA) -> set[int]:
    """States reachable from the start that can reach an accepting state."""
    if a.live is None:
        a.live = _find_live(a)
    return a.live


def _find_live(a: DFA) -> set[int]:
    reach = {0}
    stack = [0]
    while stack:
        for _, _, t in a.edges[stack.pop()]:
            if t not in reach:
                reach.add(t)
                stack.append(t)
    rev: dict[int, set[int]] = {}
    for s in reach:
        for _, _, t in a.edges[s]:
            rev.setdefault(t, set()).add(s)
    live = {s for s in a.accept if s in reach}
    stack = list(live)
    while stack:
        for p in rev.get(stack.pop(), ()):
            if p not in live:
                live.add(p)
                stack.append(p)
    return live


# Class ranges -> the items its JSON encoding contributes to ``seq(encoding, next)``; key
# automata of different objects repeat the same edge classes. Bounded like encode_class's cache.
_HEADS: dict[tuple[tuple[int, int], ...], tuple[Expr, ...]] = {}
_MAX_HEADS = 8192


def encoded_head(ranges: tuple[tuple[int, int], ...]) -> tuple[Expr, ...]:
    """``encode_class(CharClass(ranges))`` as sequence items (cached by ranges)."""
    head = _HEADS.get(ranges)
    if head is None:
        enc = encode_class(CharClass(ranges))
        head = enc.items if isinstance(enc, Seq) else () if isinstance(enc, Empty) else (enc,)
        if len(_HEADS) >= _MAX_HEADS:
            _HEADS.clear()
        _HEADS[ranges] = head
    return head


def dfa_to_rules(a: DFA, prefix: str) -> tuple[Expr, list[tuple[str, Expr]]]:
    """JSON-encoded right-linear rules ``{prefix}{state}``; returns the start expression and rules."""
    live = _live(a)
    if 0 not in live:
        return Alt(()), []
    rules: list[tuple[str, Expr]] = []
    refs: dict[int, Ref] = {}
    empty = Empty()
    for s in sorted(live):
        by_target: dict[int, list[tuple[int, int]]] = {}
        for lo, hi, t in a.edges[s]:
            if t in live:
                by_target.setdefault(t, []).append((lo, hi))
        # Built directly as seq(encode_class(...), Ref) and alt(...) would: the branches end in
        # distinct references and none is an Alt, so alt() would neither flatten nor drop any.
        branches: list[Expr] = []
        for t, rs in by_target.items():
            ref = refs.get(t)
            if ref is None:
                ref = refs[t] = Ref(f"{prefix}{t}")
            head = encoded_head(tuple(rs))
            branches.append(Seq((*head, ref)) if head else ref)
        if s in a.accept:
            branches.append(empty)
        body = branches[0] if len(branches) == 1 else Alt(tuple(branches))
        rules.append((f"{prefix}{s}", body))
    return Ref(f"{prefix}0"), rules


def dfa_accepts(a: DFA, text: str) -> bool:
    """Whether ``a`` accepts ``text``."""
    s = 0
    for ch in text:
        cp = ord(ch)
        for lo, hi, t in a.edges[s]:
            if lo <= cp <= hi:
                s = t
                break
        else:
            return False
    return s in a.accept


register_cache(_HEADS)
