"""GBNF front end: llama.cpp's grammar dialect (plus ``_`` in rule names) to the IR.

Layout follows llama.cpp's recursive-descent parser: a rule ends at a newline, except that
newlines are allowed right after ``::=``, after ``|`` and anywhere inside parentheses; ``#``
starts a comment to the end of the line. Parenthesised groups stay separate IR nodes, so
``parse_gbnf(str(g)) == g`` for grammars built with the IR constructors. Beyond llama.cpp's
dialect it reads the printed forms of the IR's two key-trie kinds, ``%key-set("a" "b")`` and
``%key-node(ends-name "a"->rule ...)``, of a unique array item, ``%unique(...)``, of a bounded
string, ``%max-length(N ...)``, and of its run-time checks, ``%check(carriers=2 accept=1,2 a b)``,
so a JSON Schema grammar reads back to an equal grammar too.
"""

from __future__ import annotations

from agent_infer.errors import GrammarDefinitionError, GrammarLimitError, GrammarSyntaxError
from agent_infer.grammar.ir import (
    MAX_CODEPOINT,
    Alt,
    BoundedString,
    CharClass,
    Check,
    Empty,
    Expr,
    Grammar,
    KeyNode,
    KeySet,
    Literal,
    Ref,
    Repeat,
    Seq,
    UniqueItem,
    walk,
)

# Parentheses nested deeper than this raise GrammarLimitError: parsing and the later passes over
# the IR (printing, serializing, lowering) recurse once per level on Python's ~1000-frame stack.
MAX_GROUP_NESTING = 100

_ESCAPES = {"n": 10, "r": 13, "t": 9, "\\": 92, '"': 34, "[": 91, "]": 93}
_HEX_LEN = {"x": 2, "u": 4, "U": 8}
_ANY = CharClass(((0, MAX_CODEPOINT),))
_NOTHING = CharClass(((0, MAX_CODEPOINT),), negated=True)  # how str(Alt(())) prints the empty language


def _is_word(c: str) -> bool:
    return len(c) == 1 and c.isascii() and (c.isalnum() or c in "-_")


class _Parser:
    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0
        self.refs: list[tuple[str, int]] = []  # (name, position) of each reference, for errors
        self.depth = 0  # open parentheses around the cursor

    # -- positions and errors --

    def where(self, pos: int) -> tuple[int, int]:
        line = self.s.count("\n", 0, pos) + 1
        return line, pos - (self.s.rfind("\n", 0, pos) + 1) + 1

    def error(self, message: str, pos: int | None = None) -> GrammarSyntaxError:
        line, column = self.where(self.i if pos is None else pos)
        return GrammarSyntaxError(f"GBNF: {message}", line=line, column=column)

    def peek(self, k: int = 0) -> str:
        j = self.i + k
        return self.s[j] if j < len(self.s) else ""

    def space(self, newline_ok: bool) -> None:
        while self.i < len(self.s):
            c = self.s[self.i]
            if c in " \t" or (newline_ok and c in "\r\n"):
                self.i += 1
            elif c == "#":
                while self.i < len(self.s) and self.s[self.i] not in "\r\n":
                    self.i += 1
            else:
                break

    # -- rules --

    def parse(self) -> list[tuple[str, Expr, int]]:
        rules: list[tuple[str, Expr, int]] = []
        self.space(True)
        while self.i < len(self.s):
            start = self.i
            name = self.name()
            self.space(False)
            if not self.s.startswith("::=", self.i):
                raise self.error("expected '::=' after rule name")
            self.i += 3
            self.space(True)
            expr = self.alternates(nested=False)
            if self.peek() == "\r":
                self.i += 1
            if self.peek() == "\n":
                self.i += 1
            elif self.i < len(self.s):
                raise self.error(f"expected newline or end of rule, found {self.peek()!r}")
            self.space(True)
            rules.append((name, expr, start))
        return rules

    def name(self) -> str:
        start = self.i
        while _is_word(self.peek()):
            self.i += 1
        if self.i == start:
            found = self.peek()
            hint = (
                "; a rule ends at a newline, so end the previous line with '|' or wrap the alternatives in ( )"
                if found == "|"
                else ""
            )
            raise self.error(
                f"expected a rule name, found {found!r}{hint}" if found else "expected a rule name"
            )
        return self.s[start : self.i]

    def alternates(self, nested: bool) -> Expr:
        branches = [self.sequence(nested)]
        while self.peek() == "|":
            self.i += 1
            self.space(True)
            branches.append(self.sequence(nested))
        return branches[0] if len(branches) == 1 else Alt(tuple(branches))

    def sequence(self, nested: bool) -> Expr:
        items: list[Expr] = []
        while self.i < len(self.s):
            c = self.peek()
            pos = self.i
            if c == '"':
                self.i += 1
                items.append(self.literal(pos))
            elif c == "[":
                self.i += 1
                items.append(self.char_class(pos))
            elif c == ".":
                self.i += 1
                items.append(_ANY)
            elif c == "%" and self.s.startswith("%unique(", pos):
                items.append(self.unique_item(pos))
            elif c == "%" and self.s.startswith("%max-length(", pos):
                items.append(self.bounded_string(pos))
            elif c == "%":
                items.append(self.check() if self.s.startswith("%check(", self.i) else self.key_trie())
            elif _is_word(c):
                name = self.name()
                self.refs.append((name, pos))
                items.append(Ref(name))
            elif c == "(":
                self.i += 1
                self.space(True)
                items.append(self.group_body(pos, "the group opened here"))
            elif c in "*+?{":
                if not items:
                    raise self.error(f"'{c}' has no preceding item to repeat")
                items[-1] = self.repetition(items[-1])
            else:
                break
            self.space(nested)
        if not items:
            return Empty()
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def repetition(self, item: Expr) -> Expr:
        c = self.s[self.i]
        self.i += 1
        if c != "{":
            bounds: dict[str, tuple[int, int | None]] = {"*": (0, None), "+": (1, None), "?": (0, 1)}
            return Repeat(item, *bounds[c])
        start = self.i - 1
        self.space(False)
        lo = self.integer()
        self.space(False)
        hi: int | None = lo
        if self.peek() == ",":
            self.i += 1
            self.space(False)
            hi = self.integer() if self.peek().isdigit() else None
            self.space(False)
        if self.peek() != "}":
            raise self.error("expected '}' to close the repetition", start)
        self.i += 1
        if hi is not None and hi < lo:
            raise self.error(f"repetition {{{lo},{hi}}} has max below min", start)
        return Repeat(item, lo, hi)

    def integer(self) -> int:
        start = self.i
        while self.peek().isascii() and self.peek().isdigit():
            self.i += 1
        if start == self.i:
            raise self.error("expected a number in the repetition")
        return int(self.s[start : self.i])

    # -- terminals --

    def char(self) -> int:
        """One possibly escaped character of a literal or class, as a code point."""
        c = self.peek()
        if not c:
            raise self.error("unexpected end of input")
        pos = self.i
        self.i += 1
        if c != "\\":
            return ord(c)
        e = self.peek()
        self.i += 1
        if e in _HEX_LEN:
            digits = self.s[self.i : self.i + _HEX_LEN[e]]
            if len(digits) != _HEX_LEN[e] or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"expected {_HEX_LEN[e]} hex digits after '\\{e}'", pos)
            self.i += len(digits)
            cp = int(digits, 16)
            if cp > MAX_CODEPOINT:
                raise self.error(f"code point {cp:#x} is beyond U+10FFFF", pos)
            return cp
        if e in _ESCAPES:
            return _ESCAPES[e]
        # Our printer escapes '-' and '^' in classes; accept any escaped punctuation as itself.
        if e and e.isascii() and not e.isalnum() and e.isprintable():
            return ord(e)
        raise self.error(f"unknown escape '\\{e}'", pos)

    def text(self, start: int) -> str:
        """The characters of a string literal up to its closing quote (the opening one is read)."""
        out: list[str] = []
        while self.peek() != '"':
            if not self.peek():
                raise self.error("unterminated string literal", start)
            out.append(chr(self.char()))
        self.i += 1
        return "".join(out)

    def literal(self, start: int) -> Expr:
        text = self.text(start)
        return Literal(text) if text else Empty()

    def unique_item(self, start: int) -> Expr:
        """``%unique(...)``: a :class:`UniqueItem` around the alternatives inside."""
        self.i += len("%unique(")
        self.space(True)
        return UniqueItem(self.group_body(start, "'%unique('"))

    def bounded_string(self, start: int) -> Expr:
        """``%max-length(N ...)``: a :class:`BoundedString` of at most N code points."""
        self.i += len("%max-length(")
        digits = self.i
        while self.peek().isdigit():
            self.i += 1
        if self.i == digits:
            raise self.error("expected the length after '%max-length('", start)
        bound = int(self.s[digits : self.i])
        self.space(True)
        return BoundedString(self.group_body(start, "'%max-length('"), bound)

    def group_body(self, start: int, opener: str) -> Expr:
        """The alternatives inside a group opened at ``start`` (its opener and the blanks after it
        read) through its ``)``, at most :data:`MAX_GROUP_NESTING` groups deep."""
        self.depth += 1
        if self.depth > MAX_GROUP_NESTING:
            line, column = self.where(start)
            raise GrammarLimitError(
                f"GBNF: groups nest deeper than {MAX_GROUP_NESTING} levels (line {line}, column {column})"
            )
        item = self.alternates(nested=True)
        self.depth -= 1
        if self.peek() != ")":
            raise self.error(f"expected ')' to close {opener}", start)
        self.i += 1
        return item

    def key_trie(self) -> Expr:
        """``%key-set("name" ...)`` or ``%key-node([ends-name] "c"->rule ...)``."""
        start = self.i
        kind = "set" if self.s.startswith("%key-set(", start) else "node"
        if not self.s.startswith(f"%key-{kind}(", start):
            raise self.error("expected '%key-set(' or '%key-node('")
        self.i += len(f"%key-{kind}(")
        self.space(True)
        spec: list[object] = []
        if kind == "node":
            spec.append(self.s.startswith("ends-name", self.i))
            if spec[0]:
                self.i += len("ends-name")
                self.space(True)
        while self.peek() == '"':
            pos = self.i
            self.i += 1
            text = self.text(pos)
            if kind == "set":
                spec.append(text)
            else:
                if len(text) != 1 or not self.s.startswith("->", self.i):
                    raise self.error("a key-node edge is one character, '->' and a rule name", pos)
                self.i += 2
                at = self.i
                rule = self.name()
                self.refs.append((rule, at))
                spec.extend((ord(text), rule))
            self.space(True)
        if self.peek() != ")":
            raise self.error(f"expected ')' to close '%key-{kind}('", start)
        self.i += 1
        return KeySet(tuple(spec)) if kind == "set" else KeyNode(tuple(spec))  # type: ignore[arg-type]

    def check(self) -> Expr:
        """``%check(carriers=N accept=M,... [product] rule ...)``."""
        start = self.i
        self.i += len("%check(")
        self.space(True)
        fields: dict[str, list[int]] = {}
        for field in ("carriers", "accept"):
            if not self.s.startswith(f"{field}=", self.i):
                raise self.error(f"expected '{field}=' in '%check('", self.i)
            self.i += len(field) + 1
            # An empty accept list (nothing passes) prints as "accept=" followed by the rules.
            numbers = [self.integer()] if field == "carriers" or self.peek().isdigit() else []
            while numbers and field == "accept" and self.peek() == ",":
                self.i += 1
                numbers.append(self.integer())
            fields[field] = numbers
            self.space(True)
        product = self.s.startswith("product ", self.i) or self.s.startswith("product)", self.i)
        if product:
            self.i += len("product")
            self.space(True)
        items: list[Ref] = []
        while self.peek() and self.peek() != ")":
            at = self.i
            rule = self.name()
            self.refs.append((rule, at))
            items.append(Ref(rule))
            self.space(True)
        if self.peek() != ")":
            raise self.error("expected ')' to close '%check('", start)
        self.i += 1
        try:
            return Check(tuple(items), fields["carriers"][0], tuple(fields["accept"]), product)
        except GrammarDefinitionError as exc:
            raise self.error(str(exc), start) from None

    def char_class(self, start: int) -> Expr:
        negated = self.peek() == "^"
        if negated:
            self.i += 1
        ranges: list[tuple[int, int]] = []
        while self.peek() != "]":
            if not self.peek():
                raise self.error("unterminated character class", start)
            lo = self.char()
            hi = lo
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.i += 1
                dash = self.i
                hi = self.char()
                if hi < lo:
                    raise self.error(f"character range {chr(lo)!r}-{chr(hi)!r} is reversed", dash)
            ranges.append((lo, hi))
        self.i += 1
        cls = CharClass(tuple(ranges), negated)
        return Alt(()) if cls == _NOTHING else cls


def parse_gbnf(text: str, *, start: str = "root") -> Grammar:
    """Parse GBNF ``text`` into a :class:`Grammar` whose root is rule ``start``.

    Raises GrammarSyntaxError (1-based line/column) for malformed text and GrammarDefinitionError
    for an undefined or twice-defined rule or a missing start rule.
    """
    parser = _Parser(text)
    parsed = parser.parse()
    defined: dict[str, int] = {}
    for name, _, pos in parsed:
        if name in defined:
            line, col = parser.where(pos)
            raise GrammarDefinitionError(
                f"GBNF rule {name!r} is defined twice (line {line}, column {col}; first on line "
                f"{parser.where(defined[name])[0]})"
            )
        defined[name] = pos
    for name, pos in parser.refs:
        if name not in defined:
            line, col = parser.where(pos)
            raise GrammarDefinitionError(
                f"GBNF rule {name!r} is used but not defined (line {line}, column {col})"
            )
    if start not in defined:
        raise GrammarDefinitionError(
            f"GBNF start rule {start!r} is not defined"
            + (f"; defined rules: {', '.join(defined)}" if defined else " (the grammar is empty)")
        )
    return Grammar(tuple((name, expr) for name, expr, _ in parsed), start)


def referenced_rules(grammar: Grammar) -> set[str]:
    """Names of the rules reachable from the root (handy for spotting dead rules in a file)."""
    seen = {grammar.root}
    stack = [grammar.root]
    rules = grammar.rule_map
    while stack:
        for node in walk(rules[stack.pop()]):
            if isinstance(node, Ref) and node.name not in seen:
                seen.add(node.name)
                stack.append(node.name)
    return seen
