"""The ``numbers="float64"`` policy: JSON numbers limited to what a float64 (or a 64-bit integer)
can hold, so a model cannot loop inside a number (``3.14159265358979323846...``, ``1111111...``).

JSON Schema puts no limit on a number's digits, and neither does ``numbers="exact"``. The policy is
a subset of the schema's language, chosen so that every value a consumer parsing JSON into float64
or int64 can tell apart keeps a spelling:

* ``number``: at most :data:`MAX_SIGNIFICANT` significant digits (from the first non-zero digit to
  the last digit written), at most :data:`MAX_LEADING_ZEROS` zeros between ``0.`` and the first
  significant digit, an exponent of at most :data:`MAX_EXPONENT_DIGITS` digits. Every double's
  shortest round-trip spelling in exponent form (``d.ddddde±XXX``) is in it.
* ``integer``: at most :data:`MAX_INTEGER_DIGITS` digits (every int64 and uint64).

Bounds and ``multipleOf`` the schema states are kept exactly: the policy is intersected with them,
an open side of an integer range is closed at the policy's limit, and where the intersection would
leave no value (``minimum: 1e30``) the schema's own language is used.
"""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING

from agent_infer.grammar.automata import DFA, dfa_intersect, dfa_is_empty, expr_to_dfa
from agent_infer.grammar.frontends.json_schema.types.automaton_rules import dfa_to_rules
from agent_infer.grammar.frontends.json_schema.types.numerals import DIGIT, NONZERO
from agent_infer.grammar.ir import Expr, Ref, Repeat, alt, chars, lit, opt, seq

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler

NUMBER_POLICIES = ("exact", "float64")

# float64 round-trips through 17 significant decimal digits; its exponent is within +-324.
MAX_SIGNIFICANT = 17
MAX_EXPONENT_DIGITS = 3
# Smaller values are written with an exponent (Python switches at 1e-5, JavaScript at 1e-7).
MAX_LEADING_ZEROS = 16
# uint64's largest value, 18446744073709551615, has 20 digits.
MAX_INTEGER_DIGITS = 20
INTEGER_LIMIT = 10**MAX_INTEGER_DIGITS - 1


def _mantissa() -> Expr:
    """Unsigned ``int[.frac]`` with at most MAX_SIGNIFICANT significant digits."""
    zeros_then_digits = seq(
        Repeat(lit("0"), 0, MAX_LEADING_ZEROS), NONZERO, Repeat(DIGIT, 0, MAX_SIGNIFICANT - 1)
    )
    below_one = seq(
        lit("0"), opt(seq(lit("."), alt(zeros_then_digits, Repeat(lit("0"), 1, MAX_SIGNIFICANT))))
    )
    # An integer part of k digits leaves MAX_SIGNIFICANT - k for the fraction (one ".0" at 17).
    at_least_one = [
        seq(
            NONZERO,
            Repeat(DIGIT, k - 1, k - 1),
            opt(seq(lit("."), Repeat(DIGIT, 1, max(MAX_SIGNIFICANT - k, 1)))),
        )
        for k in range(1, MAX_SIGNIFICANT + 1)
    ]
    return alt(below_one, *at_least_one)


EXPONENT = seq(chars("eE"), opt(chars("+-")), Repeat(DIGIT, 1, MAX_EXPONENT_DIGITS))
NUMBER = seq(opt(lit("-")), _mantissa(), opt(EXPONENT))
INTEGER = seq(opt(lit("-")), alt(lit("0"), seq(NONZERO, Repeat(DIGIT, 0, MAX_INTEGER_DIGITS - 1))))

_POLICY_DFA: list[DFA] = []


def _policy_dfa() -> DFA:
    if not _POLICY_DFA:
        _POLICY_DFA.append(expr_to_dfa(NUMBER))
    return _POLICY_DFA[0]


def close_integer_range(lo: Fraction | None, hi: Fraction | None) -> tuple[Fraction | None, Fraction | None]:
    """An integer range's open sides closed at +-INTEGER_LIMIT, unless the other side lies beyond
    the limit (no value would be left): then the range stays as the schema gives it."""
    limit = Fraction(INTEGER_LIMIT)
    if hi is None and (lo is None or lo <= limit):
        hi = limit
    if lo is None and hi is not None and -limit <= hi <= limit:
        lo = -limit
    return lo, hi


def limit_dfa(exact: DFA) -> DFA:
    """A number automaton intersected with the policy; ``exact`` itself when nothing is left."""
    both = dfa_intersect(exact, _policy_dfa())
    return exact if dfa_is_empty(both) else both


def limit_number(c: Compiler, exact: Expr, pointer: str) -> Expr:
    """``exact`` (a number language without rule references) intersected with the policy, written as
    rules; ``exact`` itself when the intersection is empty."""
    both = dfa_intersect(expr_to_dfa(exact), _policy_dfa())
    if dfa_is_empty(both):
        return exact
    prefix = c.fresh(f"{pointer}-f64")
    start, rules = dfa_to_rules(both, prefix + "-")
    c.rules.update(rules)
    c.rules[prefix] = start
    return Ref(prefix)
