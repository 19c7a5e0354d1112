"""Code point tables for the regex front end: ``\\d \\w \\s`` per dialect, ``.``, case folding.

Python's ``re`` gives ``\\d \\w \\s`` Unicode meaning for str patterns; rather than re-deriving
the rules from ``unicodedata`` we ask ``re`` itself once per class over every code point and cache
the resulting ranges, so the two can never disagree on this interpreter.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from functools import cache

from agent_infer.grammar.ir import MAX_CODEPOINT, complement_ranges, merge_ranges

Ranges = tuple[tuple[int, int], ...]

# ECMA-262 WhiteSpace + LineTerminator, the set `\s` denotes in JSON Schema patterns.
_ECMA_SPACE: Ranges = (
    (0x09, 0x0D),
    (0x20, 0x20),
    (0xA0, 0xA0),
    (0x1680, 0x1680),
    (0x2000, 0x200A),
    (0x2028, 0x2029),
    (0x202F, 0x202F),
    (0x205F, 0x205F),
    (0x3000, 0x3000),
    (0xFEFF, 0xFEFF),
)
_ASCII = {
    "d": ((0x30, 0x39),),
    "w": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
    "s": ((0x09, 0x0D), (0x20, 0x20)),
}


def merge(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """Sort and merge overlapping or adjacent inclusive ranges."""
    return merge_ranges(ranges)


def complement(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """All code points not in ``ranges``."""
    return complement_ranges(ranges)


@cache
def _all_code_points() -> str:
    return "".join(map(chr, range(MAX_CODEPOINT + 1)))


@cache
def _python_unicode(letter: str) -> Ranges:
    # One finditer over a string of every code point: runs of matches are exactly the ranges.
    text = _all_code_points()
    return tuple((m.start(), m.end() - 1) for m in re.finditer(f"\\{letter}+", text))


def shorthand(letter: str, dialect: str, ascii_only: bool = False) -> Ranges:
    """Ranges of ``\\d``/``\\w``/``\\s`` (lowercase letter) for ``dialect`` ("python" or "ecma")."""
    if dialect == "ecma":
        return _ECMA_SPACE if letter == "s" else _ASCII[letter]
    if ascii_only:
        return _ASCII[letter]
    return _python_unicode(letter)


def dot(dialect: str, dotall: bool) -> tuple[Ranges, bool]:
    """(ranges, negated) of ``.``: everything but newline (Python) or line terminators (ECMA)."""
    if dotall:
        return ((0, MAX_CODEPOINT),), False
    if dialect == "ecma":
        return ((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)), True
    return ((0x0A, 0x0A),), True


@cache
def _category_ranges(prefix: str) -> Ranges:
    out: list[tuple[int, int]] = []
    for cp in range(MAX_CODEPOINT + 1):
        if unicodedata.category(chr(cp)).startswith(prefix):
            if out and out[-1][1] == cp - 1:
                out[-1] = (out[-1][0], cp)
            else:
                out.append((cp, cp))
    return tuple(out)


_CATEGORY_ALIASES = {
    "Letter": "L",
    "Lowercase_Letter": "Ll",
    "Uppercase_Letter": "Lu",
    "Titlecase_Letter": "Lt",
    "Modifier_Letter": "Lm",
    "Other_Letter": "Lo",
    "Mark": "M",
    "Number": "N",
    "Decimal_Number": "Nd",
    "Letter_Number": "Nl",
    "Other_Number": "No",
    "Punctuation": "P",
    "Symbol": "S",
    "Separator": "Z",
    "Space_Separator": "Zs",
    "Other": "C",
    "Control": "Cc",
}


def unicode_property(name: str) -> Ranges | None:
    """Ranges of a general-category property such as ``L``, ``Lu``, ``gc=Nd``; None if unknown."""
    for key in ("General_Category=", "gc="):
        if name.startswith(key):
            name = name[len(key) :]
    name = _CATEGORY_ALIASES.get(name, name)
    if len(name) in (1, 2) and name[0] in "LMNPSZC" and (len(name) == 1 or name[1].islower()):
        ranges = _category_ranges(name)
        return ranges or None
    return None


@cache
def _case_twins() -> dict[int, tuple[int, ...]]:
    """Code point -> the other code points it matches case-insensitively.

    Characters are joined when one is the single-character lower or upper case of the other
    (so K, k and the Kelvin sign, or s, S and the long s, end up together), which is how
    ``re`` with IGNORECASE relates str characters. One scan of every code point, cached.
    """
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.get(x, x) != x:
            x = parent[x]
        return x

    for cp in range(MAX_CODEPOINT + 1):
        ch = chr(cp)
        # U+0130 is the one character whose full lowercase is longer than its simple one ("i").
        for other in (ch.lower()[:1], ch.upper()):
            if len(other) == 1 and other != ch:
                a, b = find(cp), find(ord(other))
                if a != b:
                    parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for cp in list(parent):
        groups.setdefault(find(cp), []).append(cp)
    twins: dict[int, tuple[int, ...]] = {}
    for root, members in groups.items():
        everyone = tuple(sorted({root, *members}))
        for cp in everyone:
            twins[cp] = everyone
    return twins


def fold_case(ranges: Ranges) -> Ranges:
    """Close ``ranges`` under case-insensitive equivalence (see :func:`_case_twins`).

    Ranges wider than a few thousand code points are left as they are: scanning them would be
    slow, and such classes (negations, ``\\w``) are already closed under case in practice.
    """
    twins = _case_twins()
    extra: list[tuple[int, int]] = []
    for lo, hi in ranges:
        if hi - lo > 4096:
            continue
        for cp in range(lo, hi + 1):
            extra.extend((t, t) for t in twins.get(cp, ()))
    return merge((*ranges, *extra))
