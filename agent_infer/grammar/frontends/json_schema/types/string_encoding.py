"""JSON string lexical pieces for the JSON Schema compiler.

Constraints on strings (``pattern``, ``format``, ``enum``, property names) are stated over the
*decoded* string, but the grammar matches the *JSON text*. :func:`encode_expr` maps a decoded-level
expression to the language of its JSON encodings:

* ASCII printable characters other than ``"`` and ``\\`` must appear raw (``\\u0041`` for ``A`` is
  rejected); ``/`` may also be written ``\\/``.
* ``"`` and ``\\`` must be escaped; control characters use a short escape or ``\\uXXXX``.
* Every other code point (non-ASCII) may appear raw or as a ``\\uXXXX`` escape (astral code points as
  a surrogate pair), since ``json.dumps`` defaults to ``ensure_ascii=True``.

Unconstrained strings use :data:`JSON_CHAR`, which accepts every JSON escape; each escape counts as
one character, so ``Repeat(JSON_CHAR, n, m)`` is exact for ``minLength``/``maxLength``.
"""

from __future__ import annotations

import functools
import re

from agent_infer.grammar.common.memo import register_cache
from agent_infer.grammar.ir import (
    Alt,
    CharClass,
    Empty,
    Expr,
    Literal,
    Ref,
    Repeat,
    Seq,
    alt,
    chars,
    lit,
    seq,
)

MAX_CP = 0x10FFFF
HEX = chars("0-9a-fA-F")
_SHORT = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}


def _hex_digit_class(lo: int, hi: int) -> CharClass:
    """Hex digits with values lo..hi, either case."""
    ranges: list[tuple[int, int]] = []
    if lo <= 9:
        ranges.append((0x30 + lo, 0x30 + min(hi, 9)))
    if hi >= 10:
        a, b = max(lo, 10) - 10, hi - 10
        ranges += [(0x61 + a, 0x61 + b), (0x41 + a, 0x41 + b)]
    return CharClass(tuple(ranges))


@functools.lru_cache(maxsize=4096)
def hex_range(lo: int, hi: int, width: int) -> Expr:
    """Fixed-width hex numerals (either case) with value in [lo, hi] (cached: a pure function)."""
    if width == 0:
        return Empty()
    unit = 16 ** (width - 1)
    dlo, rlo = divmod(lo, unit)
    dhi, rhi = divmod(hi, unit)
    if dlo == dhi:
        return seq(_hex_digit_class(dlo, dlo), hex_range(rlo, rhi, width - 1))
    parts: list[Expr] = []
    full = unit - 1
    start, end = dlo, dhi
    if rlo != 0:
        parts.append(seq(_hex_digit_class(dlo, dlo), hex_range(rlo, full, width - 1)))
        start += 1
    tail: list[Expr] = []
    if rhi != full:
        tail.append(seq(_hex_digit_class(dhi, dhi), hex_range(0, rhi, width - 1)))
        end -= 1
    if start <= end:
        parts.append(seq(_hex_digit_class(start, end), *([HEX] * (width - 1))))
    return alt(*parts, *tail)


@functools.lru_cache(maxsize=4096)
def _u_escape(lo: int, hi: int) -> Expr:
    """``\\uXXXX`` escapes (surrogate pairs for astral code points) of code points lo..hi (cached:
    key automata escape the same control and non-ASCII ranges in many edge classes)."""
    out: list[Expr] = []
    bmp_hi = min(hi, 0xFFFF)
    # Lone surrogates are not characters; escapes of them are not generated.
    for a, b in ((lo, min(bmp_hi, 0xD7FF)), (max(lo, 0xE000), bmp_hi)):
        if a <= b:
            out.append(seq(lit("\\u"), hex_range(a, b, 4)))
    if hi > 0xFFFF:
        a = max(lo, 0x10000)
        ha, la = divmod(a - 0x10000, 0x400)
        hb, lb = divmod(hi - 0x10000, 0x400)

        def pair(h1: int, h2: int, l1: int, l2: int) -> Expr:
            return seq(
                lit("\\u"),
                hex_range(0xD800 + h1, 0xD800 + h2, 4),
                lit("\\u"),
                hex_range(0xDC00 + l1, 0xDC00 + l2, 4),
            )

        if ha == hb:
            out.append(pair(ha, ha, la, lb))
        else:
            out.append(pair(ha, ha, la, 0x3FF))
            if ha + 1 <= hb - 1:
                out.append(pair(ha + 1, hb - 1, 0, 0x3FF))
            out.append(pair(hb, hb, 0, lb))
    return alt(*out)


def _subtract(ranges: tuple[tuple[int, int], ...], lo: int, hi: int) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if b < lo or a > hi:
            out.append((a, b))
            continue
        if a < lo:
            out.append((a, lo - 1))
        if b > hi:
            out.append((hi + 1, b))
    return out


@functools.lru_cache(maxsize=8192)
def encode_class(cls: CharClass) -> Expr:
    """The JSON-text encodings of one code point from ``cls`` (see module docstring).

    When ``cls`` contains every non-ASCII code point, that part is ``Ref(HIGH_RULE)`` (the caller
    defines it as :data:`HIGH_EXPR`): negated classes are common and their escape forms are large.
    Cached: schemas repeat the same classes and literal characters, and the escape grammars of
    wide ranges are costly to rebuild (IR nodes are immutable, so sharing results is safe).
    """
    ranges = cls.normalized()
    high: list[Expr] = []
    if any(a <= 0x80 and b == MAX_CP for a, b in ranges):
        ranges = tuple((a, min(b, 0x7F)) for a, b in ranges if a <= 0x7F)
        high.append(Ref(HIGH_RULE))
    raw = _subtract(ranges, 0, 0x1F)
    raw = _subtract(tuple(raw), 0x22, 0x22)
    raw = _subtract(tuple(raw), 0x5C, 0x5C)
    parts: list[Expr] = []
    if raw:
        parts.append(CharClass(tuple(raw)))

    def has(cp: int) -> bool:
        return any(a <= cp <= b for a, b in ranges)

    for cp, esc in _SHORT.items():
        if has(cp):
            parts.append(Literal(esc))
    if has(0x2F):
        parts.append(Literal("\\/"))
    for a, b in ranges:
        # Controls may always be \u-escaped; non-ASCII may be too. ASCII printables may not.
        for lo, hi in ((a, min(b, 0x1F)), (max(a, 0x7F), b)):
            if lo <= hi:
                parts.append(_u_escape(lo, hi))
    parts += high
    return alt(*parts) if parts else Alt(())


def encode_expr(expr: Expr) -> Expr:
    """Map a decoded-string expression to the expression of its JSON-text encodings."""
    if isinstance(expr, Literal):
        return seq(*(encode_class(CharClass(((ord(c), ord(c)),))) for c in expr.text))
    if isinstance(expr, CharClass):
        return encode_class(expr)
    if isinstance(expr, Seq):
        return seq(*(encode_expr(e) for e in expr.items))
    if isinstance(expr, Alt):
        return Alt(tuple(encode_expr(e) for e in expr.items)) if expr.items else expr
    if isinstance(expr, Repeat):
        return Repeat(encode_expr(expr.item), expr.min, expr.max)
    if isinstance(expr, Empty | Ref):
        return expr
    raise TypeError(f"not an IR node: {expr!r}")


def encode_literal(text: str) -> Expr:
    """A decoded string literal as JSON text, without the quotes."""
    # Fast path: plain printable ASCII (U+0020..U+007E; str methods run in C) needs no alternatives.
    if text.isascii() and text.isprintable() and '"' not in text and "\\" not in text and "/" not in text:
        return lit(text)
    # Runs of plain characters stay literals; only the others (``/``, controls, non-ASCII: names,
    # paths and URLs in long enums) get their alternatives, one cached expression per code point.
    parts: list[Expr] = []
    at = 0
    for m in _NOT_PLAIN.finditer(text):
        if m.start() > at:
            parts.append(Literal(text[at : m.start()]))
        cp = ord(m.group())
        enc = _CHAR_ENCODINGS.get(cp)
        if enc is None:
            if len(_CHAR_ENCODINGS) >= 4096:
                _CHAR_ENCODINGS.clear()
            enc = _CHAR_ENCODINGS[cp] = encode_class(CharClass(((cp, cp),)))
        parts.append(enc)
        at = m.end()
    if at < len(text):
        parts.append(Literal(text[at:]))
    return seq(*parts)


# Characters that a JSON string cannot always write raw, or may also write escaped.
_NOT_PLAIN = re.compile(r'[^\x20-\x7e]|["\\/]')
_CHAR_ENCODINGS: dict[int, Expr] = {}


# Any single character of a JSON string body, with every escape form.
JSON_CHAR: Expr = alt(
    CharClass(((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)), negated=True),
    seq(lit("\\"), chars('"\\/bfnrt')),
    seq(lit("\\u"), alt(seq(chars("0-9a-cA-Ce-fE-F"), HEX), seq(chars("dD"), chars("0-7"))), HEX, HEX),
    seq(
        lit("\\u"), chars("dD"), chars("89abAB"), HEX, HEX, lit("\\u"), chars("dD"), chars("c-fC-F"), HEX, HEX
    ),
)


HIGH_RULE = "char-high"
# Any non-ASCII code point: raw, \uXXXX, or a surrogate pair.
HIGH_EXPR: Expr = alt(CharClass(((0x80, MAX_CP),)), _u_escape(0x80, MAX_CP))

register_cache(hex_range)
register_cache(_u_escape)
register_cache(encode_class)
register_cache(_CHAR_ENCODINGS)
