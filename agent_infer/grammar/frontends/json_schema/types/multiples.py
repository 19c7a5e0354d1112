"""``multipleOf`` of any step, under any bounds: a digit automaton for the multiples, intersected
with the bounded numeral automaton (:mod:`.numerals`), written as right-linear rules.

A decimal ``x`` is a multiple of ``p/q`` (lowest terms) exactly when it is a multiple of ``p/q'``,
``q'`` the part of ``q`` made of 2s and 5s (a finite decimal absorbs no other factor), and
``p/q' = p*t / 10**m`` with ``t = 10**m / q'``: ``10**m * x`` must be a whole multiple of
``P = p*t``. So the automaton reads the integer digits and the first ``m`` fraction digits as one
number modulo ``P`` (what it has read is ``r``; after ``f`` fraction digits the value so far is
``r * 10**(m - f)``), and past ``m`` fraction digits only zeros. ``multipleOf: 1.5``: ``P = 15``,
``m = 1``; ``0.01``: ``P = 1``, ``m = 2``; an integer step ``n``: ``P = n``, ``m = 0``.
"""

from __future__ import annotations

from fractions import Fraction

from agent_infer.errors import GrammarLimitError
from agent_infer.grammar.automata import DFA, dfa_intersect, expr_to_dfa
from agent_infer.grammar.frontends.json_schema.types import numerals as num

MAX_MULTIPLE_MODULUS = 400
"""The largest ``P`` (states per fraction position) the automaton is built for."""


def step_modulus(step: Fraction, integer: bool) -> tuple[int, int]:
    """``(P, m)`` for multiples of ``step`` (for an integer: of its numerator, ``m = 0``)."""
    p, q = step.numerator, step.denominator
    if integer:
        return p, 0
    twos = fives = 0
    while q % 2 == 0:
        q //= 2
        twos += 1
    while q % 5 == 0:
        q //= 5
        fives += 1
    m = max(twos, fives)
    t = 10**m // (2**twos * 5**fives)
    return p * t, m


def multiples_dfa(step: Fraction, integer: bool) -> DFA:
    """Numerals (``-?(0|[1-9][0-9]*)(\\.[0-9]+)?``, no fraction for an integer) whose value is a
    multiple of ``step``."""
    modulus, m = step_modulus(step, integer)
    if modulus > MAX_MULTIPLE_MODULUS:
        raise GrammarLimitError(
            f"multipleOf {step} needs {modulus} residues per digit, above the limit {MAX_MULTIPLE_MODULUS}"
        )
    edges: list[list[tuple[int, int, int]]] = []
    accept: set[int] = set()
    index: dict[tuple[str, int, int], int] = {}
    keys: list[tuple[str, int, int]] = []

    def state(kind: str, r: int = 0, f: int = 0) -> int:
        key = (kind, r, f)
        if key not in index:
            index[key] = len(edges)
            keys.append(key)
            edges.append([])
            if kind == "int" and r * 10**m % modulus == 0:
                accept.add(index[key])
            if kind == "frac" and f > 0 and r * 10 ** max(m - f, 0) % modulus == 0:
                accept.add(index[key])
        return index[key]

    start = state("start")
    sign = state("sign")
    zero = state("int0")
    accept.add(zero)
    pending = [start]
    seen = {start}
    while pending:
        s = pending.pop()
        kind, r, f = keys[s]
        out: list[tuple[int, int, int]] = []
        if kind in ("start", "sign"):
            if kind == "start":
                out.append((ord("-"), ord("-"), sign))
            out.append((ord("0"), ord("0"), zero))
            out.extend((ord(str(d)), ord(str(d)), state("int", d % modulus)) for d in range(1, 10))
        elif kind in ("int", "int0"):
            if kind == "int":
                out.extend(
                    (ord(str(d)), ord(str(d)), state("int", (r * 10 + d) % modulus)) for d in range(10)
                )
            if not integer:
                out.append((ord("."), ord("."), state("frac", r, 0)))
        elif f < m:
            out.extend(
                (ord(str(d)), ord(str(d)), state("frac", (r * 10 + d) % modulus, f + 1)) for d in range(10)
            )
        else:
            out.append((ord("0"), ord("0"), state("frac", r, max(f, 1))))
        out.sort()
        edges[s] = _merged(out)
        for _, _, t in out:
            if t not in seen:
                seen.add(t)
                pending.append(t)
    return DFA(edges, accept)


def _merged(out: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    merged: list[tuple[int, int, int]] = []
    for lo, hi, t in out:
        if merged and merged[-1][2] == t and merged[-1][1] + 1 == lo:
            merged[-1] = (merged[-1][0], hi, t)
        else:
            merged.append((lo, hi, t))
    return merged


def bounded_multiples_dfa(
    step: Fraction,
    lo: Fraction | None,
    lo_strict: bool,
    hi: Fraction | None,
    hi_strict: bool,
    integer: bool,
) -> DFA | None:
    """Multiples of ``step`` inside the bounds (written without an exponent, as bounded numbers
    are), or None when a bound is not a finite decimal."""
    dfa = multiples_dfa(step, integer)
    if lo is None and hi is None:
        return dfa
    bounded = num.bounded_number(lo, lo_strict, hi, hi_strict, integer)
    if bounded is None:
        return None
    return dfa_intersect(dfa, expr_to_dfa(bounded))
