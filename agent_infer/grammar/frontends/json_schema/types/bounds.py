"""Numeric keyword values read exactly: counts (``minLength``, ``maxItems``, ...) as integers and
bounds (``minimum``, ``multipleOf``, ...) as Fractions, each checked against what the grammar can
write."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

from agent_infer.errors import GrammarLimitError, InvalidSchemaError
from agent_infer.grammar.frontends.json_schema.values.canon import to_fraction

# Counts are written as binary "doubling" rules, one level per bit (RuleWriter.repeat): past 64
# bits no text could reach the bound anyway, and thousand-bit counts nest too deep to build.
MAX_COUNT = 2**64 - 1


def count(flat: dict[str, Any], key: str, pointer: str) -> int | None:
    """A non-negative integer keyword (``2.0`` counts as 2), or None when absent.

    Raises InvalidSchemaError for anything else (booleans, non-finite numbers) and
    GrammarLimitError for a count above :data:`MAX_COUNT`.
    """
    if key not in flat:
        return None
    v = flat[key]
    if (
        isinstance(v, bool)
        or not isinstance(v, int | float)
        or (isinstance(v, float) and not math.isfinite(v))
        or v < 0
        or v != int(v)
    ):
        raise InvalidSchemaError(f"{key} must be a non-negative integer", pointer=f"{pointer}/{key}")
    if v > MAX_COUNT:
        raise GrammarLimitError(
            f"{key} at {pointer}/{key} is above the largest supported count {MAX_COUNT} (2**64 - 1)"
        )
    return int(v)


# Bounds are written digit by digit, one nested alternative per digit that is neither a leading
# zero nor part of the run of 0s or 9s that ends it (types/numerals.py): numbers are limited in
# significant digits (100 covers 128-bit integers and high-precision decimals) and in all digits
# (400 covers every double, 1.7976931348623157e308 and 5e-324 included).
MAX_SIGNIFICANT_DIGITS = 100


MAX_NUMBER_DIGITS = 400


def number(flat: dict[str, Any], key: str, pointer: str) -> Fraction | None:
    """A numeric keyword as an exact Fraction, or None when absent.

    Raises InvalidSchemaError for a non-number or a non-finite one, and GrammarLimitError for a
    value past :data:`MAX_SIGNIFICANT_DIGITS` or :data:`MAX_NUMBER_DIGITS`.
    """
    if key not in flat:
        return None
    v = flat[key]
    if (
        isinstance(v, bool)
        or not isinstance(v, int | float)
        or (isinstance(v, float) and not math.isfinite(v))
    ):
        raise InvalidSchemaError(f"{key} must be a finite number", pointer=f"{pointer}/{key}")
    f = to_fraction(v)
    total, significant = _digit_counts(f)
    if significant > MAX_SIGNIFICANT_DIGITS or total > MAX_NUMBER_DIGITS:
        raise GrammarLimitError(
            f"{key} at {pointer}/{key} has more than {MAX_SIGNIFICANT_DIGITS} significant digits "
            f"or {MAX_NUMBER_DIGITS} digits in all"
        )
    return f


def _digit_counts(f: Fraction) -> tuple[int, int]:
    """(all digits, digits from the first to the last non-zero one) of ``f``'s decimal expansion;
    a bound that is no finite decimal counts its numerator and denominator."""
    den, twos, fives = f.denominator, 0, 0
    while den % 2 == 0:
        den //= 2
        twos += 1
    while den % 5 == 0:
        den //= 5
        fives += 1
    if den != 1:
        size = len(str(abs(f.numerator))) + len(str(f.denominator))
        return size, size
    scale = max(twos, fives)
    digits = str(abs(f.numerator) * 10**scale // f.denominator)
    return max(len(digits), scale + 1), len(digits.strip("0"))
