"""Canonical number spellings (applicators/canonical_numbers.py): every number grammar of
``numbers="exact"`` accepts a canonical spelling (no exponent, no fraction ending in 0) exactly
when the value is valid, and a number-typed schema limited to them accepts no other spelling.

The check items of a ``oneOf``/``not`` judge each other's numbers through this property."""

from __future__ import annotations

import json
from fractions import Fraction
from typing import Any

import pytest

from agent_infer.grammar import Grammar, GrammarCompiler, GrammarMatcher, TokenizerInfo
from agent_infer.grammar.frontends.json_schema.applicators.canonical_numbers import CANONICAL_KEY

SCHEMAS: list[dict[str, Any]] = [
    {},
    {"type": "number"},
    {"type": "integer"},
    {"type": "number", "minimum": 0},
    {"type": "integer", "minimum": 0},
    {"type": "number", "maximum": 0},
    {"type": "number", "exclusiveMinimum": 0},
    {"type": "number", "exclusiveMaximum": 0},
    {"type": "integer", "exclusiveMaximum": 0},
    {"type": "number", "minimum": -5, "maximum": 5},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"type": "number", "exclusiveMinimum": -1, "maximum": 3.5},
    {"type": "number", "multipleOf": 3},
    {"type": "integer", "multipleOf": 3},
    {"type": "number", "multipleOf": 3, "minimum": 0},
    {"type": "integer", "multipleOf": 3, "minimum": 0},
    {"type": "number", "multipleOf": 3, "exclusiveMinimum": 0},
    {"type": "number", "multipleOf": 3, "maximum": 0},
    {"type": "integer", "multipleOf": 3, "maximum": 0},
    {"type": "number", "multipleOf": 0.5, "minimum": -2, "maximum": 2},
    {"type": "integer", "multipleOf": 2, "minimum": -4, "maximum": 4},
    {"type": "number", "multipleOf": 0.01},
]

CANONICAL = sorted(
    {
        sign + whole + frac
        for whole in ("0", "1", "2", "3", "4", "5", "6", "9", "12", "1024")
        for sign in ("", "-")
        for frac in ("", ".5", ".25", ".05", ".1", ".01")
    }
)
OTHER = ["1.0", "2.50", "0.0", "-0.0", "1e2", "3E0", "1.5e1"]


def _valid(schema: dict[str, Any], v: Fraction) -> bool:
    """The schema's verdict on the number ``v``, in exact arithmetic."""

    def bound(key: str) -> Fraction:
        return Fraction(str(schema[key]))

    checks = {
        "minimum": lambda: v >= bound("minimum"),
        "maximum": lambda: v <= bound("maximum"),
        "exclusiveMinimum": lambda: v > bound("exclusiveMinimum"),
        "exclusiveMaximum": lambda: v < bound("exclusiveMaximum"),
        "multipleOf": lambda: (v / bound("multipleOf")).denominator == 1,
    }
    if schema.get("type") == "integer" and v.denominator != 1:
        return False
    return all(check() for key, check in checks.items() if key in schema)


def _accepts(compiled: Any, text: str) -> bool:
    m = GrammarMatcher(compiled)
    return m.accept_string(text) and m.can_terminate()


@pytest.mark.parametrize("schema", SCHEMAS, ids=json.dumps)
def test_number_grammars_are_exact_on_canonical_spellings(schema: dict[str, Any]) -> None:
    compiler = GrammarCompiler(TokenizerInfo.bytes_only(), cache_enabled=False)
    plain = compiler.compile(Grammar.from_json_schema(schema))
    limited = compiler.compile(Grammar.from_json_schema({**schema, CANONICAL_KEY: True}))
    for text in CANONICAL:
        want = _valid(schema, Fraction(text))
        assert _accepts(plain, text) == want, text
        assert _accepts(limited, text) == want, text
    for text in OTHER:
        assert not _accepts(limited, text), text
