"""Lexical half of the regex reader: escapes, character classes and the parse-time markers.

Split from :mod:`.regex` (which owns the structure: groups, quantifiers, anchors) to keep each
file short; nothing here is public.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass

from agent_infer.errors import ConfigError, GrammarSyntaxError, UnsupportedRegexError
from agent_infer.grammar.frontends.regex import classes as rc
from agent_infer.grammar.ir import MAX_CODEPOINT, CharClass, Expr, Literal

_DIALECTS = ("python", "ecma")
_SIMPLE_ESCAPES = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7}


@dataclass(frozen=True)
class _Anchor(Expr):
    """Parse-time marker for ``^``/``$``-like anchors; never left in a returned tree."""

    start: bool
    pos: int


@dataclass
class _Flags:
    ignorecase: bool = False
    dotall: bool = False
    ascii: bool = False
    verbose: bool = False


class _Reader:
    """Pattern text, cursor and dialect, with the escape and class readers."""

    def __init__(self, pattern: str, dialect: str) -> None:
        if dialect not in _DIALECTS:
            raise ConfigError(f"unknown regex dialect {dialect!r}; expected one of {_DIALECTS}")
        self.p = pattern
        self.i = 0
        self.dialect = dialect

    # -- helpers --

    def error(self, message: str, pos: int | None = None) -> GrammarSyntaxError:
        return GrammarSyntaxError(f"invalid regex: {message}", position=self.i if pos is None else pos)

    def unsupported(self, construct: str, pos: int) -> UnsupportedRegexError:
        return UnsupportedRegexError(
            f"{construct} is not supported: it has no context-free equivalent",
            position=pos,
        )

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.p[j] if j < len(self.p) else ""

    def skip_verbose(self, flags: _Flags) -> None:
        while flags.verbose and self.i < len(self.p):
            c = self.p[self.i]
            if c in " \t\n\r\f\v":
                self.i += 1
            elif c == "#":
                while self.i < len(self.p) and self.p[self.i] != "\n":
                    self.i += 1
            else:
                break

    # -- single characters, with case folding --

    def char(self, cp: int, flags: _Flags) -> Expr:
        if flags.ignorecase:
            ranges = rc.fold_case(((cp, cp),))
            if len(ranges) > 1 or ranges[0][0] != ranges[0][1]:
                return CharClass(ranges)
        return Literal(chr(cp))

    def cls(self, ranges: rc.Ranges, flags: _Flags, negated: bool = False) -> CharClass:
        return CharClass(rc.fold_case(ranges) if flags.ignorecase else rc.merge(ranges), negated)

    # -- groups --

    def escape(self, flags: _Flags, pos: int, in_class: bool) -> Expr:
        """Parse after the backslash. Returns a Literal (single char) or a CharClass."""
        c = self.peek()
        if not c:
            raise self.error("bad escape (end of pattern)", pos)
        self.i += 1
        ecma = self.dialect == "ecma"
        if c in "dwsDWS":
            ranges = rc.shorthand(c.lower(), self.dialect, flags.ascii)
            return CharClass(ranges, c.isupper())
        if c in ("p", "P") and ecma:
            return self.property_escape(c == "P", pos)
        if c == "b" and in_class:
            return Literal("\b")
        if c in "bB":
            raise self.unsupported(f"word boundary '\\{c}'", pos)
        if not in_class and c in "AZz":
            return _Anchor(c == "A", pos)
        if c.isdigit() and c != "0" and not in_class:
            raise self.unsupported(f"backreference '\\{c}'", pos)
        if c == "k" and ecma:
            raise self.unsupported("named backreference '\\k'", pos)
        cp = self.escape_code_point(c, pos)
        return self.char(cp, flags)

    def escape_code_point(self, c: str, pos: int) -> int:
        ecma = self.dialect == "ecma"
        if c in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[c]
        if c == "x":
            return self.hex_digits(2, pos)
        if c == "u":
            if ecma and self.peek() == "{":
                end = self.p.find("}", self.i)
                digits = self.p[self.i + 1 : end] if end > 0 else ""
                if not digits or any(d not in "0123456789abcdefABCDEF" for d in digits):
                    raise self.error("bad \\u{...} escape", pos)
                self.i = end + 1
                return self.check_cp(int(digits, 16), pos)
            cp = self.hex_digits(4, pos)
            # ECMA writes astral characters as surrogate pairs: join them into one code point.
            if ecma and 0xD800 <= cp <= 0xDBFF and self.p[self.i : self.i + 2] == "\\u":
                save = self.i
                self.i += 2
                low = self.hex_digits(4, pos)
                if 0xDC00 <= low <= 0xDFFF:
                    return 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00)
                self.i = save
            return cp
        if c == "U" and not ecma:
            return self.check_cp(self.hex_digits(8, pos), pos)
        if c == "N" and not ecma and self.peek() == "{":
            end = self.p.find("}", self.i)
            try:
                cp = ord(unicodedata.lookup(self.p[self.i + 1 : end]))
            except KeyError:
                raise self.error("undefined character name in \\N{...}", pos) from None
            self.i = end + 1
            return cp
        if c == "c" and ecma and self.peek().isascii() and self.peek().isalpha():
            self.i += 1
            return ord(self.p[self.i - 1]) % 32
        if c == "0":
            digits = "0"
            while len(digits) < 3 and self.peek() in "01234567" and self.peek() and not ecma:
                digits += self.peek()
                self.i += 1
            return int(digits, 8)
        if c.isascii() and c.isalnum():
            if ecma and c not in "0123456789":
                return ord(c)  # identity escape (Annex B, non-unicode mode)
            raise self.error(f"bad escape '\\{c}'", pos)
        return ord(c)

    def check_cp(self, cp: int, pos: int) -> int:
        if cp > MAX_CODEPOINT:
            raise self.error("code point out of range", pos)
        return cp

    def hex_digits(self, n: int, pos: int) -> int:
        digits = self.p[self.i : self.i + n]
        if len(digits) != n or any(d not in "0123456789abcdefABCDEF" for d in digits):
            raise self.error(f"incomplete escape, expected {n} hex digits", pos)
        self.i += n
        return int(digits, 16)

    def property_escape(self, negated: bool, pos: int) -> Expr:
        if self.peek() != "{":
            raise self.error("expected '{' after \\p", pos)
        end = self.p.find("}", self.i)
        name = self.p[self.i + 1 : end] if end > 0 else ""
        ranges = rc.unicode_property(name)
        if ranges is None:
            raise self.unsupported(f"Unicode property '\\p{{{name}}}'", pos)
        self.i = end + 1
        return CharClass(ranges, negated)

    def char_class(self, flags: _Flags, pos: int) -> CharClass:
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        first = True
        while True:
            c = self.peek()
            if not c:
                raise self.error("unterminated character set", pos)
            if c == "]" and not (first and self.dialect == "python"):
                self.i += 1
                break
            first = False
            lo_item = self.class_atom(flags)
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                dash = self.i
                self.i += 1
                hi_item = self.class_atom(flags)
                if isinstance(lo_item, int) and isinstance(hi_item, int):
                    if hi_item < lo_item:
                        raise self.error("bad character range", dash)
                    ranges.append((lo_item, hi_item))
                    continue
                if self.dialect == "python":
                    raise self.error("bad character range", dash)
                ranges.append((0x2D, 0x2D))  # ECMA Annex B: `[\d-x]` is a literal '-'
                for item in (lo_item, hi_item):
                    ranges.extend([(item, item)] if isinstance(item, int) else item)
                continue
            ranges.extend([(lo_item, lo_item)] if isinstance(lo_item, int) else lo_item)
        return self.cls(tuple(ranges), flags, negated)

    def class_atom(self, flags: _Flags) -> int | rc.Ranges:
        """One class member: a code point, or the ranges of a shorthand like ``\\d``."""
        c = self.p[self.i]
        pos = self.i
        self.i += 1
        if c != "\\":
            return ord(c)
        plain = _Flags(ascii=flags.ascii)  # case folding is applied to the whole class later
        expr = self.escape(plain, pos, in_class=True)
        if isinstance(expr, Literal):
            return ord(expr.text)
        assert isinstance(expr, CharClass)
        return expr.normalized()


# --- anchors: validate edges, then drop (full match) or turn into search padding ---------------------
