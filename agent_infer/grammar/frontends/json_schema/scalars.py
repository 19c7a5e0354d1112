"""Strings (lengths, patterns, formats) and numbers (bounds, multipleOf) for the JSON Schema compiler."""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from agent_infer.errors import (
    GrammarLimitError,
    GrammarSyntaxError,
    InvalidSchemaError,
    UnsupportedRegexError,
    UnsupportedSchemaError,
)
from agent_infer.grammar.automata.dfa import (
    DFA,
    dfa_complement,
    dfa_includes,
    dfa_intersect,
    dfa_length,
    dfa_to_rules,
    expr_to_dfa,
)
from agent_infer.grammar.compile.caches import register_cache
from agent_infer.grammar.frontends.json_schema import numbers as num
from agent_infer.grammar.frontends.json_schema.formats import FORMATS
from agent_infer.grammar.frontends.json_schema.lengths import bounded_pattern, bounded_rules, dfa_bound_length
from agent_infer.grammar.frontends.json_schema.merge import to_fraction
from agent_infer.grammar.frontends.json_schema.names import names_dfa
from agent_infer.grammar.frontends.json_schema.prefixes import literal_prefixes, prefixed_format
from agent_infer.grammar.frontends.json_schema.text import encode_expr
from agent_infer.grammar.ir import Alt, Expr, Ref, Repeat, Seq, alt, chars, lit, opt, plus, seq, star

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.entry import Compiler

# String characters repeat inline up to this count (other items: Compiler.repeat's default):
# one chain of positions, whose masks the native cache shares across positions (short-token
# masks), instead of doubling rules whose block ends make most tokens uncertain. About 35
# automaton states per position.
MAX_INLINE_CHAR_REPEAT = 256
# The native compiler keeps rules with longer counted repeats out of their callers (kMaxInlineRepeat
# in grammar_compile.cpp).
_MAX_INLINED_REPEAT = 32

# Extra formats that are cheap to state exactly.
_JSON_POINTER = star(seq(lit("/"), star(alt(chars("~/", negated=True), seq(lit("~"), chars("01"))))))
EXTRA_FORMATS = {
    "json-pointer": lambda: _JSON_POINTER,
    "relative-json-pointer": lambda: seq(num.uint_range(0, None), alt(lit("#"), _JSON_POINTER)),
}


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
# zero nor part of the run of 0s or 9s that ends it (json_schema_numbers): numbers are limited in
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


def _patterns(flat: dict[str, Any], pointer: str) -> list[str]:
    p = flat.get("pattern")
    if p is None:
        return []
    pats = p["__patterns"] if isinstance(p, dict) and "__patterns" in p else [p]
    for x in pats:
        if not isinstance(x, str):
            raise InvalidSchemaError("pattern must be a string", pointer=f"{pointer}/pattern")
    return list(pats)


def string_body(c: Compiler, flat: dict[str, Any], pointer: str) -> Expr | None:
    """The JSON text between the quotes, or None if the string constraints were all dropped."""
    lo = count(flat, "minLength", pointer) or 0
    hi = count(flat, "maxLength", pointer)
    if hi is not None and hi < lo:
        return None
    pats = _patterns(flat, pointer)
    if not c.strict:
        # Non-strict: a pattern the regex front end cannot compile is dropped with a warning.
        usable = []
        for p in pats:
            try:
                pattern_search(p, f"{pointer}/pattern")
                usable.append(p)
            except UnsupportedSchemaError as exc:
                c.unsupported("pattern", f"{pointer}/pattern", str(exc))
        pats = usable
    fmt = flat.get("format")
    fmt_expr: Expr | None = None
    fmt_name = ""  # the format, where fmt_expr is set
    if fmt is not None:
        if not isinstance(fmt, str):
            raise InvalidSchemaError("format must be a string", pointer=f"{pointer}/format")
        fmt_name = fmt
        fmt_expr = _format_expr(fmt)
        if fmt_expr is None:
            c.unsupported("format", f"{pointer}/format", f"unknown format {fmt!r}")
    # Complements from `not` (see json_schema_negate): excluded values and patterns.
    excluded = [x for x in flat.get("__not_values", []) if isinstance(x, str)]
    not_pats = list(flat.get("__not_patterns", []))
    plain = not excluded and not not_pats
    if not pats and fmt_expr is None and plain:
        return c.repeat(c.char, lo, hi, MAX_INLINE_CHAR_REPEAT)
    if (lo or hi is not None) and (fmt_expr is not None or len(pats) > 1):
        # Lengths that one of several constraints already implies (an email format under
        # ``minLength: 3``, a ``^https://`` pattern next to it) bound the intersection too:
        # dropped, they leave one product automaton factor fewer, or none.
        for implied in [fmt_expr, *(pattern_search(p, f"{pointer}/pattern") for p in pats)]:
            if implied is not None and bounded_pattern(implied, lo, hi) is implied:
                lo, hi = 0, None
                break
    if len(pats) == 1 and fmt_expr is None and lo == 0 and hi is None and plain:
        return pattern_search(pats[0], f"{pointer}/pattern", encoded=True)
    if not pats and fmt_expr is not None and lo == 0 and hi is None and plain:
        return _encoded_format(fmt_name)
    if len(pats) == 1 and fmt_expr is not None and lo == 0 and hi is None and plain:
        leads = literal_prefixes(pattern_search(pats[0], f"{pointer}/pattern"))
        narrowed = [prefixed_format(fmt_expr, lead) for lead in leads or ()]
        if narrowed and all(n is not None for n in narrowed):
            return encode_expr(alt(*(n for n in narrowed if n is not None)))
    if len(pats) == 1 and fmt_expr is None and plain:
        bounded = bounded_pattern(pattern_search(pats[0], f"{pointer}/pattern"), lo, hi)
        if bounded is not None:
            return _encode_counted(c, bounded)
    if not pats and fmt_expr is not None and plain:
        # A format under lengths (``"format": "email", "minLength": 3``) needs no product
        # automaton when the bound reads off the format's expression.
        bounded = bounded_pattern(fmt_expr, lo, hi)
        if bounded is fmt_expr:
            return _encoded_format(fmt_name)
        if bounded is not None:
            return _encode_counted(c, bounded)
    key = (tuple(pats), tuple(not_pats), tuple(excluded), fmt if fmt_expr is not None else None, lo, hi)
    shared = c.string_products.get(key)
    if shared is not None:
        return shared
    if len(pats) + (fmt_expr is not None) > 1:
        # Memoized under the full key, so a repeated field walks the inclusion test once.
        reduced = _without_implied(c, flat, pats, fmt_name if fmt_expr is not None else None, pointer)
        if reduced is not None:
            body = string_body(c, reduced, pointer)
            if body is not None:
                c.string_products[key] = body
            return body
    dfas = [c.pattern_dfa(p, f"{pointer}/pattern") for p in pats]
    dfas += [dfa_complement(c.pattern_dfa(p, f"{pointer}/not/pattern")) for p in not_pats]
    if excluded:
        dfas.append(dfa_complement(names_dfa(excluded)))
    if fmt_expr is not None:
        dfas.append(_format_dfa(fmt_name))
    if not dfas:
        dfas.append(dfa_length(0, None))
    dfa = dfas[0]
    for other in dfas[1:]:
        dfa = dfa_intersect(dfa, other)
    if hi is not None:
        prefix = c.fresh(f"{pointer}-str")
        start, rules = bounded_rules(dfa, lo, hi, prefix + "-")
    else:
        if lo:
            dfa = dfa_bound_length(dfa, lo, hi)
        prefix = c.fresh(f"{pointer}-str")
        start, rules = dfa_to_rules(dfa, prefix + "-")
    for name, expr in rules:
        c.rules[name] = expr
    c.rules[prefix] = start
    c.string_products[key] = Ref(prefix)
    return Ref(prefix)


def _without_implied(
    c: Compiler, flat: dict[str, Any], pats: list[str], fmt_name: str | None, pointer: str
) -> dict[str, Any] | None:
    """``flat`` less the patterns (or format) that another of its constraints implies, or None when
    none is implied. A pattern like ``^.*@.*$`` beside ``format: email`` changes nothing in their
    intersection; dropped, the other's own encoding serves and no product automaton is built."""
    try:
        dfas = [c.pattern_dfa(p, f"{pointer}/pattern") for p in pats]
        if fmt_name is not None:
            dfas.append(_format_dfa(fmt_name))
    except GrammarLimitError:
        return None  # the product path reports the limit with its own context
    dropped: set[int] = set()
    for i, wide in enumerate(dfas):
        # One of two equal languages stays: only a constraint not yet dropped can imply another.
        if any(j != i and j not in dropped and dfa_includes(narrow, wide) for j, narrow in enumerate(dfas)):
            dropped.add(i)
    if not dropped:
        return None
    out = dict(flat)
    kept = [p for i, p in enumerate(pats) if i not in dropped]
    if len(pats) in dropped:
        del out["format"]
    if not kept:
        out.pop("pattern", None)
    else:
        out["pattern"] = kept[0] if len(kept) == 1 else {"__patterns": kept}
    return out


def _encode_counted(c: Compiler, expr: Expr) -> Expr:
    """``encode_expr`` whose long counted repeats (moved there from a length bound) become
    chunked or doubling rules instead of one state per counted item."""
    if isinstance(expr, Repeat):
        n = expr.max if expr.max is not None else expr.min
        if n > MAX_INLINE_CHAR_REPEAT:
            return c.repeat(_encode_counted(c, expr.item), expr.min, expr.max, MAX_INLINE_CHAR_REPEAT)
        return Repeat(_encode_counted(c, expr.item), expr.min, expr.max)
    if isinstance(expr, Seq):
        return seq(*(_encode_counted(c, e) for e in expr.items))
    if isinstance(expr, Alt) and expr.items:
        return Alt(tuple(_encode_counted(c, e) for e in expr.items))
    return encode_expr(expr)


# Format expressions, their JSON encodings and automata depend on the format's name alone, from a
# fixed table (a date-time expression is ~2 000 IR nodes, its encoding more): library constants,
# built at first use and kept for the process like the JSON character rules, not memos of earlier
# schemas (so clear_grammar_caches leaves them). Only names in the table are ever stored.
_FORMAT_EXPRS: dict[str, Expr] = {}
_ENCODED_FORMATS: dict[str, Expr] = {}
_FORMAT_DFAS: dict[str, DFA] = {}


def _format_expr(name: str) -> Expr | None:
    found = _FORMAT_EXPRS.get(name)
    if found is None:
        make = FORMATS.get(name) or EXTRA_FORMATS.get(name)
        if make is None:
            return None
        found = _FORMAT_EXPRS.setdefault(name, make())
    return found


def _encoded_format(name: str) -> Expr:
    found = _ENCODED_FORMATS.get(name)
    if found is None:
        expr = _format_expr(name)
        assert expr is not None  # only called for known formats
        found = _ENCODED_FORMATS.setdefault(name, encode_expr(expr))
    return found


def _format_dfa(name: str) -> DFA:
    # DFAs are only read once built (their cached live set is a pure function of them).
    found = _FORMAT_DFAS.get(name)
    if found is None:
        expr = _format_expr(name)
        assert expr is not None
        found = _FORMAT_DFAS.setdefault(name, expr_to_dfa(expr))
    return found


@functools.lru_cache(maxsize=1024)
def _encoded_search(pattern: str) -> Expr:
    """The JSON encoding of the strings containing a match of ``pattern`` (errors propagate uncached)."""
    from agent_infer.grammar.frontends.regex.search import regex_search_expr

    return encode_expr(regex_search_expr(pattern, dialect="ecma"))


def pattern_search(pattern: str, pointer: str, *, encoded: bool = False) -> Expr:
    """The strings containing a match of ``pattern`` (JSON-encoded when ``encoded``), with the
    regex's errors as schema errors that name ``pointer``."""
    from agent_infer.grammar.frontends.regex.search import regex_search_expr

    try:
        return _encoded_search(pattern) if encoded else regex_search_expr(pattern, dialect="ecma")
    except UnsupportedRegexError as exc:
        raise UnsupportedSchemaError(
            f"pattern {pattern!r}: {exc}", keyword="pattern", pointer=pointer
        ) from exc
    except GrammarSyntaxError as exc:
        raise InvalidSchemaError(f"pattern {pattern!r} is not a valid regex: {exc}", pointer=pointer) from exc
    except GrammarLimitError as exc:
        # The regex names its position; the pointer says which pattern.
        raise GrammarLimitError(f"{exc} (at {pointer or '/'})") from exc


def lower_string(c: Compiler, flat: dict[str, Any], pointer: str) -> Expr:
    """A JSON string under minLength/maxLength/pattern/format."""
    body = string_body(c, flat, pointer)
    if body is None:
        return alt()
    if _has_long_repeat(body, 3):
        # A long counted chain (≈ 35 automaton states per character) is built once per bound and
        # kept out of its callers (the compiler does not inline repeats this long); the closing
        # quote stays inside, so the rule finishes only after it.
        return c.shared_rule("string", seq(lit('"'), body, lit('"')))
    return seq(lit('"'), body, lit('"'))


def _has_long_repeat(expr: Expr, depth: int) -> bool:
    """Whether ``expr`` holds (near its top) a counted repeat the compiler will not inline."""
    if isinstance(expr, Repeat):
        return (expr.max if expr.max is not None else expr.min) > _MAX_INLINED_REPEAT
    return depth > 0 and any(_has_long_repeat(ch, depth - 1) for ch in expr.children())


def _bounds(flat: dict[str, Any], pointer: str) -> tuple[Fraction | None, bool, Fraction | None, bool]:
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
    """A JSON number (or integer literal) under bounds and multipleOf."""
    lo, lo_strict, hi, hi_strict = _bounds(flat, pointer)
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
    c.unsupported("multipleOf", f"{pointer}/multipleOf", "multipleOf with these bounds is not supported")
    return num.INTEGER if integer else num.NUMBER


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
        body = positive if lo_strict else alt(zero, positive)
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
    lo, lo_strict, hi, hi_strict = _bounds(flat, pointer)
    if lo is None and hi is None:
        return fractional
    bounded = num.bounded_number(lo, lo_strict, hi, hi_strict, False)
    if bounded is None:
        c.unsupported("not", f"{pointer}/not", "bound is not a finite decimal")
        return fractional
    # Both languages are regular over ASCII: intersect them as automata.
    prefix = c.fresh(f"{pointer}-frac")
    start, rules = dfa_to_rules(dfa_intersect(expr_to_dfa(fractional), expr_to_dfa(bounded)), prefix + "-")
    c.rules.update(rules)
    c.rules[prefix] = start
    return Ref(prefix)


register_cache(_encoded_search)
