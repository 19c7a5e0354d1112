"""Numbers written in one spelling, so the number grammars of a check's items judge each other.

Number grammars differ in the spellings they read: ``integer`` reads no fraction (``1.0`` is an
integer to JSON Schema), bounded grammars read no exponent, the free grammar reads both. Where
the items of a check (applicators/checks.py) constrain numbers differently, each item's number
grammar must reject another item's text exactly when its schema rejects the value. Every number
grammar of ``numbers="exact"`` is exact on the *canonical* spellings: no exponent and no fraction
that ends in ``0``; ``-0`` is one (0 as every grammar reads it). So the number-typed items are limited to them
(``"__canonical_numbers": true`` beside the item's keywords); integer-typed ones never write
anything else. A value loses only its other spellings (``1e3``, ``2.50``), a false negative of
the checked schema alone.

``numbers="float64"`` limits digits differently per grammar (a residue automaton keeps every
digit, an integer 20 of them, a number 17 significant ones): items are not rewritten there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_infer.grammar.automata import dfa_intersect, expr_to_dfa
from agent_infer.grammar.frontends.json_schema.types.automaton_rules import dfa_to_rules
from agent_infer.grammar.frontends.json_schema.types.bounds import number
from agent_infer.grammar.frontends.json_schema.types.multiples import bounded_multiples_dfa
from agent_infer.grammar.frontends.json_schema.types.numbers import lower_number, number_bounds
from agent_infer.grammar.frontends.json_schema.types.numerals import DIGIT, INTEGER, NONZERO
from agent_infer.grammar.ir import Expr, Ref, lit, opt, seq, star

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler

CANONICAL_KEY = "__canonical_numbers"
CANONICAL = seq(INTEGER, opt(seq(lit("."), star(DIGIT), NONZERO)))


def may_canonicalize(c: Compiler, members: list[Any]) -> bool:
    """Whether the number-admitting ``members`` (flattened) may be limited to canonical spellings:
    exact numbers, and no listed values (an ``enum`` grammar reads every spelling of its values)."""
    if c.numbers != "exact":
        return False
    return not any(isinstance(m, dict) and ("enum" in m or "const" in m) for m in members)


def canonicalized(member: Any) -> Any:
    """``member`` with its numbers limited to canonical spellings."""
    if member is True:
        return {CANONICAL_KEY: True}
    return {**member, CANONICAL_KEY: True}


def lower_canonical_number(c: Compiler, flat: dict[str, Any], pointer: str) -> Expr:
    """A number-typed schema's numbers in canonical spellings only."""
    expr = lower_number(c, flat, pointer, integer=False)
    if not _has_ref(expr):
        both = dfa_intersect(expr_to_dfa(expr), expr_to_dfa(CANONICAL))
    else:
        step = number(flat, "multipleOf", pointer)
        if step is None or step.denominator == 1:
            # Multiples of an integer (a residue automaton, or a digit automaton between bounds):
            # its values are integers, and the integer grammar is the number one less the ".0"
            # fractions.
            return lower_number(c, flat, pointer, integer=True)
        # Multiples of a fraction: the digit automaton the rules were written from, in canonical
        # spellings.
        lo, lo_strict, hi, hi_strict = number_bounds(flat, pointer)
        dfa = bounded_multiples_dfa(step, lo, lo_strict, hi, hi_strict, False)
        if dfa is None:
            return expr  # a bound lower_number already refused (non-strict: its warning stands)
        both = dfa_intersect(dfa, expr_to_dfa(CANONICAL))
    prefix = c.fresh(f"{pointer}-canonical")
    start, rules = dfa_to_rules(both, prefix + "-")
    c.rules.update(rules)
    c.rules[prefix] = start
    return Ref(prefix)


def _has_ref(e: Expr) -> bool:
    return isinstance(e, Ref) or any(_has_ref(child) for child in e.children())
