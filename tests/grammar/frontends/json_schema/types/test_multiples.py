"""``multipleOf`` of any step under any bounds (types/multiples.py): the language equals the
exact decimal oracle (value a whole multiple of the step, inside the bounds) on every numeral of
a candidate set, for number and integer types."""

from __future__ import annotations

import itertools
from fractions import Fraction
from typing import Any

import pytest

from agent_infer.errors import GrammarLimitError
from agent_infer.grammar import Grammar
from agent_infer.grammar.frontends.json_schema.types.multiples import multiples_dfa, step_modulus
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer

SCHEMAS: list[dict[str, Any]] = [
    {"type": "number", "multipleOf": 1, "minimum": 1},
    {"type": "number", "multipleOf": 1, "minimum": 0, "maximum": 100000},
    {"type": "number", "multipleOf": 0.01, "minimum": 0, "maximum": 99999999999.99},
    {"type": "number", "multipleOf": 11, "minimum": 100},
    {"type": "number", "multipleOf": 1.5},
    {"type": "number", "multipleOf": 0.25, "exclusiveMinimum": -1, "maximum": 2},
    {"type": "integer", "multipleOf": 1.5, "maximum": 30},
    {"type": "number", "multipleOf": 0.3, "minimum": -0.9, "exclusiveMaximum": 1.2},
    {"type": "integer", "multipleOf": 7, "minimum": -20, "maximum": 20},
]

NUMERALS = [
    *("0", "-0", "1", "1.0", "1.00", "1.5", "1.50", "3", "3.0", "4.5", "6", "7", "-7", "14", "21", "-21"),
    *("0.25", "0.3", "0.30", "0.6", "0.9", "-0.9", "-0.3", "1.2", "1.25", "0.1", "0.01", "0.001", "12.34"),
    *("99", "100", "110", "121", "132", "99999", "100000", "100001", "2", "2.0", "2.25", "-0.75", "-1"),
    *("99999999999.99", "99999999999.999", "99999999999.990", "100000000000", "33", "30", "45", "1e2"),
]


def _value_ok(schema: dict[str, Any], text: str) -> bool:
    x = Fraction(text)
    step = Fraction(str(schema["multipleOf"]))
    if schema["type"] == "integer" and ("." in text or "e" in text):
        return False
    if "e" in text:
        return False  # bounded numbers are written without an exponent (documented)
    if x % step:
        return False
    lo, hi = schema.get("minimum"), schema.get("maximum")
    xlo, xhi = schema.get("exclusiveMinimum"), schema.get("exclusiveMaximum")
    return (
        (lo is None or x >= Fraction(str(lo)))
        and (hi is None or x <= Fraction(str(hi)))
        and (xlo is None or x > Fraction(str(xlo)))
        and (xhi is None or x < Fraction(str(xhi)))
    )


@pytest.mark.parametrize("schema", SCHEMAS, ids=str)
def test_multiples_under_bounds_are_exact(schema: dict[str, Any]) -> None:
    rec = ReferenceRecognizer(Grammar.from_json_schema(schema))
    wrong = [
        t
        for t in NUMERALS
        if rec.accepts(t) != _value_ok(schema, t) and not ("e" in t and "minimum" not in schema)
    ]
    assert not wrong, wrong


def test_the_digit_automaton_counts_residues_exactly() -> None:
    """Multiples of 1.5 among all short numerals: exactly those the decimal value says."""
    from agent_infer.grammar.automata import dfa_accepts

    dfa = multiples_dfa(Fraction(3, 2), integer=False)
    for digits in itertools.product("0123456789.", repeat=3):
        text = "".join(digits)
        try:
            x = Fraction(text)
        except ValueError:
            continue
        well_formed = (
            text[0] != "." and text[-1] != "." and not (len(text) > 1 and text[0] == "0" and text[1] != ".")
        )
        assert dfa_accepts(dfa, text) == (well_formed and x % Fraction(3, 2) == 0), text
    assert step_modulus(Fraction(3, 2), False) == (15, 1)
    assert step_modulus(Fraction(1, 100), False) == (1, 2)
    assert step_modulus(Fraction(1, 3), False) == (1, 0)  # a third has no finite decimal: integers


def test_a_step_past_the_modulus_limit_is_a_limit_error() -> None:
    with pytest.raises(GrammarLimitError, match="residues"):
        Grammar.from_json_schema({"type": "number", "multipleOf": 997, "minimum": 1, "maximum": 10**7})
