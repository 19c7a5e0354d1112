"""JSON numbers under ``minimum``/``maximum``/``exclusive*``/``multipleOf``: the bounds read from
the schema and lowered to the exact numeral grammars of :mod:`.numerals`, to a residue automaton
for multiples of an integer, or to the digit automaton of :mod:`.multiples` intersected with the
bounds."""

from __future__ import annotations

from fractions import Fraction
from typing import TYPE_CHECKING, Any

from agent_infer.errors import GrammarLimitError, InvalidSchemaError
from agent_infer.grammar.automata import dfa_intersect, expr_to_dfa
from agent_infer.grammar.frontends.json_schema.types import number_policy as policy
from agent_infer.grammar.frontends.json_schema.types import numerals as num
from agent_infer.grammar.frontends.json_schema.types.automaton_rules import dfa_to_rules
from agent_infer.grammar.frontends.json_schema.types.bounds import number
from agent_infer.grammar.frontends.json_schema.types.multiples import bounded_multiples_dfa
from agent_infer.grammar.ir import Expr, Ref, Repeat, alt, chars, lit, opt, plus, seq, star

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler


def number_bounds(flat: dict[str, Any], pointer: str) -> tuple[Fraction | None, bool, Fraction | None, bool]:
    """(lower bound, exclusive, upper bound, exclusive) of a number schema; None where open."""
    lo, lo_strict = number(flat, "minimum", pointer), False
    xlo = number(flat, "exclusiveMinimum", pointer)
    if xlo is not None and (lo is None or xlo >= lo):
        lo, lo_strict = xlo, True
    hi, hi_strict = number(flat, "maximum", pointer), False
    xhi = number(flat, "exclusiveMaximum", pointer)
    if xhi is not None and (hi is None or xhi <= hi):
        hi, hi_strict = xhi, True
    return lo, lo_strict, hi, hi_strict


def lower_number(c: Compiler, flat: dict[str, Any], pointer: str, *, integer: bool) -> Expr:
    """A JSON number (or integer literal) under bounds and multipleOf, limited by the compiler's
    number policy (:mod:`.number_policy`) where the schema leaves the digits open."""
    if c.numbers == "exact":
        return _lower_number(c, flat, pointer, integer=integer)
    if not integer:
        exact = _lower_number(c, flat, pointer, integer=False)
        if exact is num.NUMBER:
            return policy.NUMBER
        # Residue automata (multipleOf an integer, one side open) are recursive rules, not one
        # expression: they keep the schema's language.
        return exact if _has_ref(exact) else policy.limit_number(c, exact, pointer)
    if "multipleOf" in flat:
        return _lower_number(c, flat, pointer, integer=True)
    lo, lo_strict, hi, hi_strict = number_bounds(flat, pointer)
    closed_lo, closed_hi = policy.close_integer_range(lo, hi)
    if closed_lo is None and closed_hi is None:
        return _lower_number(c, flat, pointer, integer=True)
    expr = num.bounded_number(
        closed_lo, lo_strict and closed_lo == lo, closed_hi, hi_strict and closed_hi == hi, True
    )
    return expr if expr is not None else _lower_number(c, flat, pointer, integer=True)


def _has_ref(e: Expr) -> bool:
    return isinstance(e, Ref) or any(_has_ref(child) for child in e.children())


def _lower_number(c: Compiler, flat: dict[str, Any], pointer: str, *, integer: bool) -> Expr:
    lo, lo_strict, hi, hi_strict = number_bounds(flat, pointer)
    step = number(flat, "multipleOf", pointer)
    if step is not None and step <= 0:
        raise InvalidSchemaError("multipleOf must be greater than 0", pointer=f"{pointer}/multipleOf")
    bounded = lo is not None or hi is not None
    if step is None:
        if not bounded:
            return num.INTEGER if integer else num.NUMBER
        expr = num.bounded_number(lo, lo_strict, hi, hi_strict, integer)
        if expr is None:
            c.unsupported("minimum", pointer, "bound is not a finite decimal")
            return num.INTEGER if integer else num.NUMBER
        return expr
    if integer and step.denominator != 1:
        step = Fraction(step.numerator)  # an integer is a multiple of p/q iff it is one of p
    listed = num.enumerate_multiples(step, lo, lo_strict, hi, hi_strict)
    if listed is not None:
        return num.exact_numerals(listed, integer)
    zero = Fraction(0)
    one_sided = not bounded or (hi is None and lo == zero) or (lo is None and hi == zero)
    if step.denominator == 1 and one_sided:
        if step > num.MAX_MODULUS:
            raise GrammarLimitError(
                f"multipleOf at {pointer}/multipleOf is above the residue automaton limit {num.MAX_MODULUS}"
            )
        return _integer_multiples(c, int(step), lo, lo_strict, hi, hi_strict, integer)
    if step.numerator == 1 and not bounded and not integer and _is_power_of_ten(step.denominator):
        k = len(str(step.denominator)) - 1
        return seq(num.INTEGER, opt(seq(lit("."), Repeat(num.DIGIT, 1, k), star(lit("0")))))
    dfa = bounded_multiples_dfa(step, lo, lo_strict, hi, hi_strict, integer)
    if dfa is None:
        c.unsupported(
            "multipleOf", f"{pointer}/multipleOf", "multipleOf with a bound that is not a finite decimal"
        )
        return num.INTEGER if integer else num.NUMBER
    prefix = c.fresh(f"{pointer}-mult")
    start, rules = dfa_to_rules(dfa, prefix + "-")
    c.rules.update(rules)
    c.rules[prefix] = start
    return Ref(prefix)


def _is_power_of_ten(n: int) -> bool:
    return n > 0 and str(n).strip("0") == "1" and str(n).startswith("1")


def _integer_multiples(
    c: Compiler,
    n: int,
    lo: Fraction | None,
    lo_strict: bool,
    hi: Fraction | None,
    hi_strict: bool,
    integer: bool,
) -> Expr:
    """Multiples of n; optionally only the non-negative or non-positive ones (bound at 0)."""
    prefix = f"mod{n}-"
    if f"{prefix}0" not in c.rules:
        for name, expr in num.residue_rules(n, prefix):
            c.rules[name] = expr
    positive = alt(*(seq(lit(str(d)), Ref(f"{prefix}{d % n}")) for d in range(1, 10)))
    zero = lit("0")
    if lo is not None:
        # -0 is 0, as every other number grammar reads it.
        body = positive if lo_strict else alt(zero, lit("-0"), positive)
    elif hi is not None:
        body = alt(seq(lit("-"), positive), *(() if hi_strict else (zero, lit("-0"))))
    else:
        body = seq(opt(lit("-")), alt(zero, positive))
    # For type "number", 4.0 is as much a multiple of 2 as 4 is.
    return body if integer else seq(body, opt(seq(lit("."), plus(lit("0")))))


def lower_non_integer(c: Compiler, flat: dict[str, Any], pointer: str) -> Expr:
    """Numbers that are not integers (``not: {type: integer}``): a fraction with a non-zero digit."""
    fractional = seq(
        opt(lit("-")), num.INT_MAGNITUDE, lit("."), star(num.DIGIT), chars("1-9"), star(num.DIGIT)
    )
    if "multipleOf" in flat:
        c.unsupported("not", f"{pointer}/not", "non-integer numbers with multipleOf are not supported")
    lo, lo_strict, hi, hi_strict = number_bounds(flat, pointer)
    if lo is None and hi is None:
        return fractional if c.numbers == "exact" else policy.limit_number(c, fractional, pointer)
    bounded = num.bounded_number(lo, lo_strict, hi, hi_strict, False)
    if bounded is None:
        c.unsupported("not", f"{pointer}/not", "bound is not a finite decimal")
        return fractional
    # Both languages are regular over ASCII: intersect them as automata.
    both = dfa_intersect(expr_to_dfa(fractional), expr_to_dfa(bounded))
    if c.numbers != "exact":
        both = policy.limit_dfa(both)
    prefix = c.fresh(f"{pointer}-frac")
    start, rules = dfa_to_rules(both, prefix + "-")
    c.rules.update(rules)
    c.rules[prefix] = start
    return Ref(prefix)
