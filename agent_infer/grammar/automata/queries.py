"""Questions about code-point DFAs: membership, emptiness, the live and universal states, and
language inclusion."""

from __future__ import annotations

from agent_infer.grammar.automata.dfa import DFA, MAX_CP, Edge


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
    live_a = live_states(a)
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


def dfa_is_empty(a: DFA) -> bool:
    """True if no string is accepted."""
    return not live_states(a)


def live_states(a: DFA) -> set[int]:
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
