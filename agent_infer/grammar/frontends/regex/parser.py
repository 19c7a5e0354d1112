"""Regex front end: Python ``re`` syntax (and the ECMA-262 flavour JSON Schema ``pattern`` uses) to IR.

Regular expressions are matched in full, so ``^``/``$``/``\\A``/``\\Z``/``\\z`` are accepted at the
pattern's edges and dropped. A JSON Schema ``pattern`` (searched in a whole string,
:mod:`.search`) may also hold lookaheads and anchors elsewhere, built as an automaton
(:mod:`.assertions`). Constructs the front end does not build (lookaround elsewhere, backreferences,
word boundaries, conditionals, atomic groups) raise :class:`UnsupportedRegexError` with the 0-based
character position. Lazy and possessive quantifiers are read as greedy.
"""

from __future__ import annotations

import re

from agent_infer.errors import GrammarLimitError, UnsupportedRegexError
from agent_infer.grammar.frontends.regex import classes as rc
from agent_infer.grammar.frontends.regex.assertions import _Look, first_lookahead
from agent_infer.grammar.frontends.regex.escapes import _Anchor, _Flags, _Reader
from agent_infer.grammar.ir import (
    MAX_CODEPOINT,
    Alt,
    CharClass,
    Empty,
    Expr,
    Grammar,
    Literal,
    Repeat,
    Seq,
    seq,
    star,
)

MAX_REPEAT_BOUND = 100_000  # beyond this the automaton would be unreasonably large
# Groups nested deeper than this raise GrammarLimitError: parsing and every later pass over the
# IR (anchor handling, printing, serializing, lowering) recurse once per level, and Python's stack
# holds ~1000 frames in all, shared with the caller's.
MAX_GROUP_NESTING = 100
# The longest run of character positions (counted repeats unrolled) a JSON Schema ``pattern``
# may have between the ``.*`` its unanchored search adds and its end. Determinizing ``.*X`` keeps
# every position of X that could still be matching, so it costs the square of that run: a
# 10,000-position literal takes seconds, ``(a{1000}){1000}`` would take hours.
MAX_SEARCH_SPAN = 20_000
ANY_STRING = star(CharClass(((0, MAX_CODEPOINT),)))
"""``.*``: the padding of an unanchored search (which :func:`position_span` does not count)."""


class RegexParser(_Reader):
    """Recursive descent over alternation > sequence > quantified atom."""

    def parse(self) -> Expr:
        self.depth = 0
        self.spans: dict[int, int] = {}  # _span's memo
        self.long_repeat: int | None = None  # the first quantifier unrolling past MAX_SEARCH_SPAN
        flags = _Flags()
        expr = self.alternation(flags)
        if self.i < len(self.p):
            raise self.error("unbalanced parenthesis ')'")
        return expr

    def alternation(self, flags: _Flags) -> Expr:
        branches = [self.sequence(flags)]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence(flags))
        return branches[0] if len(branches) == 1 else Alt(tuple(branches))

    def sequence(self, flags: _Flags) -> Expr:
        items: list[Expr] = []
        while True:
            self.skip_verbose(flags)
            c = self.peek()
            if c in ("", "|", ")"):
                break
            start = self.i
            atom = self.atom(flags)
            if atom is None:  # a flag group or comment: no text
                continue
            atom = self.quantifiers(atom, start, flags)
            if isinstance(atom, Literal) and items and isinstance(items[-1], Literal):
                items[-1] = Literal(items[-1].text + atom.text)
            else:
                items.append(atom)
        if not items:
            return Empty()
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def quantifiers(self, atom: Expr, start: int, flags: _Flags) -> Expr:
        quantified = False
        while True:
            self.skip_verbose(flags)
            pos = self.i
            bounds = self.quantifier()
            if bounds is None:
                return atom
            if quantified:
                raise self.error("multiple repeat", pos)
            if isinstance(atom, _Anchor | _Look):
                raise self.error("nothing to repeat (quantified anchor or lookahead)", pos)
            lo, hi = bounds
            if max(lo, hi or 0) > MAX_REPEAT_BOUND:
                raise GrammarLimitError(f"regex repeat bound above {MAX_REPEAT_BOUND} (position {pos})")
            atom = Repeat(atom, lo, hi)
            if self.long_repeat is None and position_span(atom, self.spans) > MAX_SEARCH_SPAN:
                self.long_repeat = pos
            quantified = True
            if self.peek() in ("?", "+"):  # lazy / possessive: same language as greedy here
                self.i += 1

    def quantifier(self) -> tuple[int, int | None] | None:
        c = self.peek()
        simple = {"*": (0, None), "+": (1, None), "?": (0, 1)}
        if c in simple:
            self.i += 1
            return simple[c]
        if c != "{":
            return None
        close = self.p.find("}", self.i)
        body = self.p[self.i + 1 : close] if close > 0 else ""
        # Python also reads `{,n}` and `{,}`; anything malformed is a literal '{' in both dialects.
        shape = r"[0-9]*(,[0-9]*)?" if self.dialect == "python" else r"[0-9]+(,[0-9]*)?"
        if close < 0 or not body or not re.fullmatch(shape, body):
            return None
        lo_s, comma, hi_s = body.partition(",")
        lo = int(lo_s) if lo_s else 0
        hi = (int(hi_s) if hi_s else None) if comma else lo
        if hi is not None and hi < lo:
            raise self.error("min repeat greater than max repeat")
        self.i = close + 1
        return lo, hi

    def atom(self, flags: _Flags) -> Expr | None:
        c = self.p[self.i]
        pos = self.i
        if c == "(":
            return self.group(flags)
        if c in "*+?" or (c == "{" and self.quantifier_at_point()):
            raise self.error("nothing to repeat")
        self.i += 1
        if c == "[":
            return self.char_class(flags, pos)
        if c == ".":
            ranges, negated = rc.dot(self.dialect, flags.dotall)
            return CharClass(ranges, negated)
        if c == "^":
            return _Anchor(True, pos)
        if c == "$":
            return _Anchor(False, pos)
        if c == "\\":
            return self.escape(flags, pos, in_class=False)
        return self.char(ord(c), flags)

    def quantifier_at_point(self) -> bool:
        save = self.i
        found = self.quantifier() is not None
        self.i = save
        return found

    def group(self, flags: _Flags) -> Expr | None:
        pos = self.i
        self.i += 1
        inner_flags = flags
        if self.peek() == "?":
            self.i += 1
            kind = self.peek()
            two = self.p[self.i : self.i + 2]
            if two in ("<=", "<!"):
                raise self.unsupported(
                    "lookbehind '(?<='" if two == "<=" else "negative lookbehind '(?<!'", pos
                )
            if kind in "=!":
                # A lookahead: regular still, built as an automaton (regex/assertions.py).
                self.i += 1
                self.depth += 1
                if self.depth > MAX_GROUP_NESTING:
                    raise GrammarLimitError(
                        f"regex groups nest deeper than {MAX_GROUP_NESTING} levels (position {pos})"
                    )
                body = self.alternation(flags)
                self.depth -= 1
                if self.peek() != ")":
                    raise self.error("missing ), unterminated subpattern", pos)
                self.i += 1
                return _Look(kind == "=", body, pos)
            if two == "P=":
                raise self.unsupported("named backreference '(?P='", pos)
            if kind == "(":
                raise self.unsupported("conditional group '(?('", pos)
            if kind == ">":
                raise self.unsupported("atomic group '(?>'", pos)
            if kind == "#":
                end = self.p.find(")", self.i)
                if end < 0:
                    raise self.error("missing ), unterminated comment", pos)
                self.i = end + 1
                return None
            if kind == ":":
                self.i += 1
            elif two == "P<" or kind == "<":
                self.i += 2 if two == "P<" else 1
                end = self.p.find(">", self.i)
                name = self.p[self.i : end] if end >= 0 else ""
                if not name.isidentifier():
                    raise self.error("bad group name", self.i)
                self.i = end + 1
            else:
                inner_flags, scoped = self.inline_flags(flags, pos)
                if not scoped:
                    return None
        self.depth += 1
        if self.depth > MAX_GROUP_NESTING:
            raise GrammarLimitError(
                f"regex groups nest deeper than {MAX_GROUP_NESTING} levels (position {pos})"
            )
        expr = self.alternation(inner_flags)
        self.depth -= 1
        if self.peek() != ")":
            raise self.error("missing ), unterminated subpattern", pos)
        self.i += 1
        return expr

    def inline_flags(self, flags: _Flags, pos: int) -> tuple[_Flags, bool]:
        """Read ``(?imsx-imsx)`` / ``(?i:``; returns the new flags and whether a scoped group follows."""
        new = _Flags(**vars(flags))
        turn_on = True
        while True:
            c = self.peek()
            self.i += 1
            if c == "-":
                turn_on = False
            elif c in ("i", "s", "x", "a", "m", "u"):
                if c == "i":
                    new.ignorecase = turn_on
                elif c == "s":
                    new.dotall = turn_on
                elif c == "x":
                    new.verbose = turn_on
                elif c == "a":
                    new.ascii = turn_on
            elif c == ")":
                if pos != 0 and self.dialect == "python":
                    raise self.error("global flags not at the start of the expression", pos)
                # A global flag group applies to the whole pattern, so mutate the caller's flags.
                vars(flags).update(vars(new))
                return flags, False
            elif c == ":":
                return new, True
            else:
                raise self.unsupported(f"inline flag {c!r}" if c else "unterminated flag group", pos)

    # -- escapes and classes --


def strip_anchors(expr: Expr, at_start: bool, at_end: bool) -> Expr:
    """Remove edge anchors; an anchor anywhere else is an error."""
    if isinstance(expr, _Anchor):
        if (expr.start and at_start) or (not expr.start and at_end):
            return Empty()
        where = "'^'/'\\A'" if expr.start else "'$'/'\\Z'"
        raise UnsupportedRegexError(
            f"anchor {where} is only supported at the edges of the pattern", position=expr.pos
        )
    if isinstance(expr, Alt):
        return Alt(tuple(strip_anchors(e, at_start, at_end) for e in expr.items))
    if isinstance(expr, Seq):
        items = expr.items
        out = []
        for k, item in enumerate(items):
            before = all(isinstance(e, _Anchor) for e in items[:k])
            after = all(isinstance(e, _Anchor) for e in items[k + 1 :])
            out.append(strip_anchors(item, at_start and before, at_end and after))
        return seq(*out)
    if isinstance(expr, Repeat):
        return Repeat(strip_anchors(expr.item, False, False), expr.min, expr.max)
    return expr


def position_span(expr: Expr, memo: dict[int, int]) -> int:
    """Positions on the longest path through ``expr`` with counted repeats unrolled (an unbounded
    repeat counts its copies plus one; ``.*`` padding counts nothing). ``memo`` is keyed by node
    identity: the IR shares subtrees, and the nodes outlive the call."""
    if expr is ANY_STRING:
        return 0
    key = id(expr)
    found = memo.get(key)
    if found is not None:
        return found
    if isinstance(expr, Literal):
        n = len(expr.text)
    elif isinstance(expr, CharClass):
        n = 1
    elif isinstance(expr, Seq):
        n = sum(position_span(e, memo) for e in expr.items)
    elif isinstance(expr, Alt):
        n = max((position_span(e, memo) for e in expr.items), default=0)
    elif isinstance(expr, Repeat):
        n = position_span(expr.item, memo) * (expr.min + 1 if expr.max is None else expr.max)
    else:
        n = 0
    memo[key] = n
    return n


def _parse_raw(pattern: str, dialect: str) -> Expr:
    return RegexParser(pattern, dialect).parse()


def parse_regex(pattern: str, *, dialect: str = "python") -> Expr:
    """Parse ``pattern`` into an IR expression matching exactly the strings it fully matches.

    ``dialect``: ``"python"`` (``re`` syntax, Unicode ``\\d\\w\\s``) or ``"ecma"`` (JSON Schema
    ``pattern``: ASCII ``\\d``/``\\w``, ECMA ``\\s``, ``\\u{...}``, ``\\p{..}`` categories).
    """
    raw = _parse_raw(pattern, dialect)
    look = first_lookahead(raw)
    if look is not None:
        # A lookahead in a terminal of a larger grammar would look past the terminal's end, which
        # a whole-string match cannot see: only patterns searched in a whole string take one.
        raise UnsupportedRegexError(
            f"{'lookahead' if look.positive else 'negative lookahead'} is not supported outside a "
            "JSON Schema pattern",
            position=look.pos,
        )
    return strip_anchors(raw, True, True)


def regex_to_grammar(pattern: str, *, dialect: str = "python") -> Grammar:
    """A one-rule grammar fully matching ``pattern`` (what :meth:`Grammar.from_regex` returns)."""
    return Grammar.from_expr(parse_regex(pattern, dialect=dialect))
