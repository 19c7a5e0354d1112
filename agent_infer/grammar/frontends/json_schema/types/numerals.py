"""Exact grammars for JSON numbers under ``minimum``/``maximum``/``exclusive*``/``multipleOf``.

Bounded numbers are emitted without an exponent part (``1e2`` is rejected when a bound applies; a
documented false negative), which keeps every bound exact: a value is a canonical integer part plus
an optional fraction, and comparisons reduce to digit-string comparisons.
"""

from __future__ import annotations

from fractions import Fraction

from agent_infer.errors import GrammarLimitError
from agent_infer.grammar.ir import Empty, Expr, Ref, alt, chars, lit, opt, seq, star

DIGIT = chars("0-9")
NONZERO = chars("1-9")
INT_MAGNITUDE = alt(lit("0"), seq(NONZERO, star(DIGIT)))
INTEGER = seq(opt(lit("-")), INT_MAGNITUDE)
FRACTION = seq(lit("."), DIGIT, star(DIGIT))
EXPONENT = seq(chars("eE"), opt(chars("+-")), DIGIT, star(DIGIT))
NUMBER = seq(INTEGER, opt(FRACTION), opt(EXPONENT))

# Above this many values a bounded multipleOf is not enumerated.
MAX_ENUMERATED = 2000
MAX_MODULUS = 400


def _digit(lo: int, hi: int) -> Expr:
    return chars(str(lo)) if lo == hi else chars(f"{lo}-{hi}")


def _fixed_range(lo: str, hi: str) -> Expr:
    """Digit strings of len(lo) == len(hi) between lo and hi (leading zeros allowed)."""
    # The common prefix is one literal, not one level of recursion per digit: bounds and enum
    # values run to thousands of digits (10**4000, its neighbours, the value itself).
    same = 0
    while same < len(lo) and lo[same] == hi[same]:
        same += 1
    if same:
        return seq(lit(lo[:same]), _fixed_range(lo[same:], hi[same:])) if same < len(lo) else lit(lo)
    if not lo:
        return Empty()
    n = len(lo) - 1
    parts: list[Expr] = []
    a, b = int(lo[0]), int(hi[0])
    if lo[1:] != "0" * n:
        parts.append(seq(lit(lo[0]), _fixed_range(lo[1:], "9" * n)))
        a += 1
    tail: list[Expr] = []
    if hi[1:] != "9" * n:
        tail.append(seq(lit(hi[0]), _fixed_range("0" * n, hi[1:])))
        b -= 1
    if a <= b:
        parts.append(seq(_digit(a, b), *([DIGIT] * n)))
    return alt(*parts, *tail)


def uint_range(lo: int, hi: int | None) -> Expr:
    """Canonical (no leading zeros) decimal integers in [lo, hi]; ``hi=None`` is unbounded."""
    if hi is not None and lo > hi:
        return alt()
    parts: list[Expr] = []
    if lo == 0:
        parts.append(lit("0"))
        lo = 1
        if hi == 0:
            return parts[0]
    width = len(str(lo))
    while hi is None or width <= len(str(hi)):
        start = max(lo, 10 ** (width - 1))
        if hi is not None and width == len(str(hi)):
            parts.append(_fixed_range(str(start), str(hi)))
            break
        if hi is None and start == 10 ** (width - 1):
            parts.append(seq(NONZERO, *([DIGIT] * (width - 1)), star(DIGIT)))
            break
        parts.append(_fixed_range(str(start), "9" * width))
        width += 1
    return alt(*parts)


# A fraction language is a union of pieces (prefix, digit range or None, tail), where tail is
# "" (nothing), "any" (digit*), "zeros" (0*) or "nz" (0*[1-9]digit*, i.e. some non-zero digit).
Piece = tuple[str, "tuple[int, int] | None", str]


def _frac_ge(d: str, strict: bool) -> list[Piece]:
    """Fraction digit strings s (possibly empty = 0) with 0.s >= 0.d (> when strict); d normalized."""
    out: list[Piece] = [(d[:i], (int(c) + 1, 9), "any") for i, c in enumerate(d) if c != "9"]
    out.append((d, None, "nz" if strict else "any"))
    return out


def _frac_le(d: str, strict: bool) -> list[Piece]:
    """Fraction digit strings s (possibly empty) with 0.s <= 0.d (< when strict); d normalized."""
    out: list[Piece] = []
    for i, c in enumerate(d):
        out.append((d[:i], None, ""))  # a proper prefix, padded with zeros, is smaller
        if c != "0":
            out.append((d[:i], (0, int(c) - 1), "any"))
    if not strict:
        out.append((d, None, "zeros"))
    return out


def _frac_between(a: str, a_strict: bool, b: str, b_strict: bool) -> list[Piece]:
    """0.a <= 0.s <= 0.b (strictness per side) for normalized digit strings with 0.a <= 0.b."""
    if a == b:
        return [] if a_strict or b_strict else [(a, None, "zeros")]
    x, y = (int(a[0]) if a else 0), int(b[0])
    out: list[Piece] = []
    if x == y:
        # Shared leading digit (or a is exhausted and b continues with 0): peel it.
        if not a and not a_strict:
            out.append(("", None, ""))
        return out + [(str(x) + p, c, t) for p, c, t in _frac_between(a[1:], a_strict, b[1:], b_strict)]
    if a:
        rest = _frac_ge(a[1:], a_strict) if a[1:] else [("", None, "nz" if a_strict else "any")]
        out += [(a[0] + p, c, t) for p, c, t in rest]
    else:
        out += [] if a_strict else [("", None, "")]
        out.append(("0", None, "nz" if a_strict else "any"))
    if x + 1 <= y - 1:
        out.append(("", (x + 1, y - 1), "any"))
    if b[1:]:
        out += [(b[0] + p, c, t) for p, c, t in _frac_le(b[1:], b_strict)]
    elif not b_strict:
        out.append((b[0], None, "zeros"))
    return out


def _with_dot(pieces: list[Piece]) -> Expr:
    """The optional ``.digits`` part whose digit string is in the union of ``pieces``."""
    tails = {
        "": Empty(),
        "any": star(DIGIT),
        "zeros": star(lit("0")),
        "nz": seq(star(lit("0")), NONZERO, star(DIGIT)),
    }
    parts: list[Expr] = []
    for prefix, rng, tail in pieces:
        body = seq(lit(prefix), _digit(*rng) if rng else Empty(), tails[tail])
        if prefix or rng or tail == "nz":
            parts.append(seq(lit("."), body))
        elif tail == "":
            parts.append(Empty())
        else:  # "any" or "zeros" with nothing before: no fraction, or a non-empty one
            parts += [Empty(), seq(lit("."), DIGIT if tail == "any" else lit("0"), tails[tail])]
    return alt(*parts)


def _split(v: Fraction) -> tuple[int, str]:
    """Integer part and normalized fraction digits of a non-negative finite decimal."""
    ip = int(v)
    rest = v - ip
    digits = ""
    while rest:
        rest *= 10
        digits += str(int(rest))
        rest -= int(rest)
    return ip, digits


def _is_decimal(v: Fraction) -> bool:
    den = v.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    return den == 1


def _ceil(v: Fraction) -> int:
    return -((-v.numerator) // v.denominator)


def magnitude(lo: Fraction, lo_strict: bool, hi: Fraction | None, hi_strict: bool, integer: bool) -> Expr:
    """Unsigned numerals (no exponent) with value in the interval; lo >= 0."""
    if integer:
        a = int(lo) + 1 if lo_strict and lo.denominator == 1 else _ceil(lo)
        b = (
            None
            if hi is None
            else (int(hi) - 1 if hi_strict and hi.denominator == 1 else hi.numerator // hi.denominator)
        )
        return uint_range(a, b)
    li, lf = _split(lo)
    if hi is None:
        return alt(
            seq(uint_range(li, li), _with_dot(_frac_ge(lf, lo_strict))),
            seq(uint_range(li + 1, None), opt(FRACTION)),
        )
    hi_i, hf = _split(hi)
    if li == hi_i:
        return seq(uint_range(li, li), _with_dot(_frac_between(lf, lo_strict, hf, hi_strict)))
    parts = [seq(uint_range(li, li), _with_dot(_frac_ge(lf, lo_strict)))]
    if li + 1 <= hi_i - 1:
        parts.append(seq(uint_range(li + 1, hi_i - 1), opt(FRACTION)))
    if hf or not hi_strict:
        parts.append(seq(uint_range(hi_i, hi_i), _with_dot(_frac_le(hf, hi_strict))))
    return alt(*parts)


def bounded_number(
    lo: Fraction | None, lo_strict: bool, hi: Fraction | None, hi_strict: bool, integer: bool
) -> Expr | None:
    """JSON numerals (without exponent) in the interval; None if a bound is not a finite decimal."""
    for v in (lo, hi):
        if v is not None and not _is_decimal(v):
            return None
    if lo is not None and hi is not None and (lo > hi or (lo == hi and (lo_strict or hi_strict))):
        return alt()
    parts: list[Expr] = []
    # Non-negative side: [max(lo, 0), hi].
    if hi is None or hi >= 0:
        plo, pstrict = (lo, lo_strict) if lo is not None and lo >= 0 else (Fraction(0), False)
        if not (hi is not None and hi == 0 and hi_strict):
            parts.append(magnitude(plo, pstrict, hi, hi_strict, integer))
    # Negative side, mirrored: magnitudes in [max(0, -hi), -lo]; "-0" is allowed when 0 is.
    if lo is None or lo <= 0:
        nlo, nstrict = (-hi, hi_strict) if hi is not None and hi <= 0 else (Fraction(0), False)
        nhi = None if lo is None else -lo
        if not (nhi is not None and nhi == 0 and lo_strict):
            parts.append(seq(lit("-"), magnitude(nlo, nstrict, nhi, lo_strict, integer)))
    return alt(*parts)


def exact_numerals(values: list[Fraction], integer: bool) -> Expr:
    """JSON numerals (without exponent) equal to one of ``values``: the language of
    ``alt(bounded_number(v, False, v, False, integer) for v in values)`` (values that are not
    finite decimals have no such numeral), built in one pass.

    Enumerated ``multipleOf`` values run into the hundreds; building each point as a bounded
    interval cost tens of µs apiece. Values that share a sign and fraction digits share one tail.
    """
    heads: dict[tuple[bool, str], list[str]] = {}  # (negative, fraction digits) -> integer parts
    for v in values:
        if not _is_decimal(v) or (integer and v.denominator != 1):
            continue
        ip, digits = _split(abs(v))
        for negative in (False, True) if v == 0 else (v < 0,):  # "-0" is allowed where 0 is
            heads.setdefault((negative, digits), []).append(str(ip))
    parts: list[Expr] = []
    for (negative, digits), ints in heads.items():
        if integer:
            tail: Expr = Empty()
        elif digits:
            tail = seq(lit("." + digits), star(lit("0")))
        else:
            tail = opt(seq(lit(".0"), star(lit("0"))))
        body = seq(alt(*(lit(i) for i in ints)), tail)
        parts.append(seq(lit("-"), body) if negative else body)
    return alt(*parts)


def listed_numbers(values: list[Fraction], spelled: list[str]) -> Expr:
    """JSON texts equal to one of ``values`` (an enum's numbers): every exponent-free numeral of
    the finite decimals, built in one pass (``exact_numerals``), and ``spelled[i]`` (the value's
    JSON text) for the others. An integer enum of HTTP codes has dozens of values; building each
    as an exact interval (``bounded_number``) cost ~60 µs apiece."""
    decimals = [v for v in values if _is_decimal(v)]
    others = [lit(t) for v, t in zip(values, spelled) if not _is_decimal(v)]
    return alt(exact_numerals(decimals, False), *others) if decimals else alt(*others)


def residue_rules(n: int, prefix: str) -> list[tuple[str, Expr]]:
    """Rules ``{prefix}{r}``: digit strings whose value v satisfies (r*10^len + v) % n == 0."""
    if n > MAX_MODULUS:
        raise GrammarLimitError(f"multipleOf {n} exceeds the residue automaton limit {MAX_MODULUS}")
    rules: list[tuple[str, Expr]] = []
    for r in range(n):
        by_target: dict[int, list[int]] = {}
        for d in range(10):
            by_target.setdefault((10 * r + d) % n, []).append(d)
        branches: list[Expr] = [
            seq(chars("".join(str(d) for d in ds)), Ref(f"{prefix}{t}")) for t, ds in by_target.items()
        ]
        if r == 0:
            branches.append(Empty())
        rules.append((f"{prefix}{r}", alt(*branches)))
    return rules


def enumerate_multiples(
    step: Fraction, lo: Fraction | None, lo_strict: bool, hi: Fraction | None, hi_strict: bool
) -> list[Fraction] | None:
    """All multiples of ``step`` in a bounded interval, or None if unbounded or too many."""
    if lo is None or hi is None:
        return None
    first = -((-lo) // step)
    last = hi // step
    if last - first + 1 > MAX_ENUMERATED:
        return None
    out = []
    for k in range(int(first), int(last) + 1):
        v = k * step
        if (lo_strict and v == lo) or (hi_strict and v == hi) or v < lo or v > hi:
            continue
        out.append(v)
    return out
