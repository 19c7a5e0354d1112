"""The Lark dialect's text to definitions (rules and terminals as IR expressions, ``%ignore``d
terminals, references to check), with ``%import common.X`` read from our own common library.
:mod:`.lark_grammar` turns them into a grammar.

Supported: rules and terminals, ``"x"``/``"x"i`` literals, ``/re/flags`` (via :func:`parse_regex`),
``"a".."z"`` ranges, ``| ? * + ~ n ~ n..m``, ``[opt]``, ``( )``, ``-> alias`` (ignored), rule
modifiers ``?``/``!``/``_`` and priorities (same language), ``%ignore`` and ``%import common.X``.
Lark's lexer picks the longest match, which a CFG cannot express; here a terminal is simply its
language, so a grammar that relies on lexer priorities may accept more strings than Lark.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from agent_infer.errors import (
    GrammarLimitError,
    GrammarSyntaxError,
    UnsupportedRegexError,
)
from agent_infer.grammar.frontends.ebnf.lark_common import COMMON_LARK
from agent_infer.grammar.frontends.regex import classes as rc
from agent_infer.grammar.frontends.regex.parser import parse_regex
from agent_infer.grammar.ir import (
    Alt,
    CharClass,
    Empty,
    Expr,
    Literal,
    Ref,
    Repeat,
    Seq,
    lit,
    seq,
    walk,
)

_TOKEN_RE = re.compile(
    r"""(?P<ws>[ \t\f\r]+|\\\r?\n)|(?P<comment>//[^\n]*)|(?P<nl>\n)
    |(?P<string>"(?:[^"\\\n]|\\.)*"i?)|(?P<regex>/(?!/)(?:[^/\\\n]|\\.)+/[imslux]*)
    |(?P<name>[!?]?[_A-Za-z][_A-Za-z0-9]*)|(?P<number>-?[0-9]+)|(?P<directive>%[a-z]+)
    |(?P<op>\.\.|->|[:|()\[\]?*+~.,{}])""",
    re.VERBOSE,
)
# '(' / '[' nested deeper than this raise GrammarLimitError: parsing and the later passes over the
# IR (ignore insertion, printing, serializing, lowering) recurse once per level on Python's stack.
MAX_GROUP_NESTING = 100


@dataclass
class Token:
    kind: str
    text: str
    pos: int


@dataclass
class Definition:
    name: str
    expr: Expr
    pos: int
    terminal: bool


@dataclass
class LarkDefinitions:
    defs: dict[str, Definition] = field(default_factory=dict)
    ignores: list[Expr] = field(default_factory=list)
    refs: list[tuple[str, int, bool]] = field(default_factory=list)  # name, position, in a terminal
    anon: int = 0


def _is_terminal(name: str) -> bool:
    return name.lstrip("_")[:1].isupper()


class LarkParser:
    def __init__(self, text: str, state: LarkDefinitions) -> None:
        self.text = text
        self.state = state
        self.toks = self.tokenize()
        self.k = 0
        self.in_terminal = False
        self.depth = 0  # open '(' / '[' around the cursor

    # -- lexing: a newline ends a statement unless the next line continues with '|' or a bracket is open --

    def tokenize(self) -> list[Token]:
        toks: list[Token] = []
        pos, depth = 0, 0
        while pos < len(self.text):
            m = _TOKEN_RE.match(self.text, pos)
            if not m:
                raise self.error(f"unexpected character {self.text[pos]!r}", pos)
            kind = m.lastgroup or ""
            if kind == "op" and m.group() in "([{":
                depth += 1
            elif kind == "op" and m.group() in ")]}":
                depth = max(0, depth - 1)
            if kind == "nl":
                rest = re.match(r"(?:\s|//[^\n]*)*", self.text[m.end() :])
                nxt = m.end() + (rest.end() if rest else 0)
                if depth == 0 and self.text[nxt : nxt + 1] != "|" and toks and toks[-1].kind != "nl":
                    toks.append(Token("nl", "\n", m.start()))
            elif kind == "name" and m.group()[0] in "!?" and toks and toks[-1].kind != "nl":
                # `a?b`: the '?' is a quantifier; '?'/'!' only prefix a name at the start of a definition.
                toks.append(Token("op", m.group()[0], m.start()))
                toks.append(Token("name", m.group()[1:], m.start() + 1))
            elif kind not in ("ws", "comment"):
                toks.append(Token(kind, m.group(), m.start()))
            pos = m.end()
        toks.append(Token("nl", "", len(self.text)))
        toks.append(Token("eof", "", len(self.text)))
        return toks

    def error(self, message: str, pos: int) -> GrammarSyntaxError:
        line = self.text.count("\n", 0, pos) + 1
        column = pos - (self.text.rfind("\n", 0, pos) + 1) + 1
        return GrammarSyntaxError(f"Lark: {message}", line=line, column=column)

    @property
    def tok(self) -> Token:
        return self.toks[self.k]

    def take(self, kind: str, text: str | None = None) -> Token:
        tok = self.tok
        if tok.kind != kind or (text is not None and tok.text != text):
            want = repr(text) if text is not None else kind
            raise self.error(f"expected {want}, found {tok.text or tok.kind!r}", tok.pos)
        self.k += 1
        return tok

    def at(self, kind: str, *texts: str) -> bool:
        return self.tok.kind == kind and (not texts or self.tok.text in texts)

    # -- statements --

    def parse(self) -> None:
        while not self.at("eof"):
            if self.at("nl"):
                self.k += 1
            elif self.at("directive"):
                self.directive()
            else:
                self.definition()

    def definition(self) -> None:
        head = self.take("name")
        name = head.text.lstrip("!?")
        if self.at("op", "{"):
            raise self.error(f"templates ({name}{{...}}) are not supported", self.tok.pos)
        if self.at("op", "."):  # priority: it only steers Lark's lexer/parser, not the language
            self.k += 1
            self.take("number")
        self.take("op", ":")
        terminal = _is_terminal(name)
        self.in_terminal = terminal
        expr = self.expansions()
        self.take("nl")
        if name in self.state.defs:
            raise self.error(f"{name!r} is defined twice", head.pos)
        self.state.defs[name] = Definition(name, expr, head.pos, terminal)

    def directive(self) -> None:
        tok = self.take("directive")
        if tok.text == "%ignore":
            self.in_terminal = True
            self.state.ignores.append(self.expansions())
        elif tok.text == "%import":
            self.import_()
        elif tok.text in ("%declare", "%override", "%extend"):
            raise self.error(f"{tok.text} is not supported (declared terminals need a custom lexer)", tok.pos)
        else:
            raise self.error(f"unknown directive {tok.text}", tok.pos)
        self.take("nl")

    def import_(self) -> None:
        start = self.tok.pos
        path = [self.take("name").text]
        while self.at("op", "."):
            self.k += 1
            path.append(self.take("name").text)
        names: list[tuple[str, str]] = []
        if self.at("op", "("):
            self.k += 1
            while not self.at("op", ")"):
                item = self.take("name").text
                names.append((item, item))
                if self.at("op", ","):
                    self.k += 1
            self.k += 1
            module = path
        else:
            module, item = path[:-1], path[-1]
            alias = item
            if self.at("op", "->"):
                self.k += 1
                alias = self.take("name").text
            names.append((item, alias))
        if module != ["common"]:
            raise self.error(f"only '%import common...' is supported, not {'.'.join(module)!r}", start)
        for item, alias in names:
            _import_common(self.state, item, alias, lambda msg: self.error(msg, start))

    # -- expressions --

    def expansions(self) -> Expr:
        branches = [self.alias()]
        while self.at("op", "|"):
            self.k += 1
            branches.append(self.alias())
        return branches[0] if len(branches) == 1 else Alt(tuple(branches))

    def alias(self) -> Expr:
        items: list[Expr] = []
        while not (self.at("nl") or self.at("eof") or self.at("op", "|", ")", "]", "->")):
            items.append(self.expr())
        if self.at("op", "->"):  # tree-shaping alias: irrelevant to the language
            self.k += 1
            self.take("name")
        if not items:
            return Empty()
        return items[0] if len(items) == 1 else Seq(tuple(items))

    def expr(self) -> Expr:
        atom = self.atom()
        if self.at("op", "?", "*", "+"):
            op = self.take("op").text
            lo, hi = {"?": (0, 1), "*": (0, None), "+": (1, None)}[op]
            return Repeat(atom, lo, hi)
        if self.at("op", "~"):
            self.k += 1
            lo = int(self.take("number").text)
            hi = lo
            if self.at("op", ".."):
                self.k += 1
                hi = int(self.take("number").text)
            if lo < 0 or hi < lo:
                raise self.error(f"bad repetition ~ {lo}..{hi}", self.tok.pos)
            return Repeat(atom, lo, hi)
        return atom

    def atom(self) -> Expr:
        tok = self.tok
        if self.at("op", "(", "["):
            self.k += 1
            self.depth += 1
            if self.depth > MAX_GROUP_NESTING:
                where = self.error("", tok.pos)
                raise GrammarLimitError(
                    f"Lark: groups nest deeper than {MAX_GROUP_NESTING} levels"
                    f" (line {where.line}, column {where.column})"
                )
            inner = self.expansions()
            self.depth -= 1
            self.take("op", ")" if tok.text == "(" else "]")
            return inner if tok.text == "(" else Repeat(inner, 0, 1)
        if tok.kind == "string":
            self.k += 1
            return self.string(tok)
        if tok.kind == "regex":
            self.k += 1
            return self.token(self.regex(tok))
        if tok.kind == "name" and tok.text[0] not in "!?":
            self.k += 1
            if self.at("op", "{"):
                raise self.error(f"template usage {tok.text}{{...}} is not supported", tok.pos)
            self.state.refs.append((tok.text, tok.pos, self.in_terminal))
            return Ref(tok.text)
        raise self.error(f"unexpected {tok.text or tok.kind!r}", tok.pos)

    def string(self, tok: Token) -> Expr:
        text, insensitive = self.unquote(tok)
        if self.at("op", ".."):
            self.k += 1
            end_tok = self.take("string")
            end, _ = self.unquote(end_tok)
            if len(text) != 1 or len(end) != 1 or ord(end) < ord(text):
                raise self.error('a range needs two single characters in order, like "a".."z"', tok.pos)
            return CharClass(((ord(text), ord(end)),))
        if not insensitive:
            return lit(text)
        return self.token(seq(*(CharClass(rc.fold_case(((ord(c), ord(c)),))) for c in text)))

    def unquote(self, tok: Token) -> tuple[str, bool]:
        insensitive = tok.text.endswith("i")
        body = tok.text[1 : -2 if insensitive else -1]
        try:
            # Lark evaluates string escapes like Python does (unknown escapes keep their backslash).
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                text = ast.literal_eval(f'"{body}"')
        except (SyntaxError, ValueError) as e:
            raise self.error(f"bad string literal: {e}", tok.pos) from None
        if not isinstance(text, str):
            raise self.error("bad string literal", tok.pos)
        return text, insensitive

    def regex(self, tok: Token) -> Expr:
        end = tok.text.rindex("/")
        pattern, flags = tok.text[1:end].replace("\\/", "/"), tok.text[end + 1 :]
        scoped = "".join(f for f in flags if f in "imsx")
        try:
            return parse_regex(f"(?{scoped}:{pattern})" if scoped else pattern)
        except UnsupportedRegexError as e:
            raise self.error(f"regex /{pattern}/ is not supported: {e}", tok.pos) from None
        except GrammarSyntaxError as e:
            raise self.error(f"bad regex /{pattern}/: {e}", tok.pos) from None

    def token(self, expr: Expr) -> Expr:
        """A multi-node token inside a rule becomes an anonymous terminal, so %ignore stays outside it."""
        if self.in_terminal or isinstance(expr, Literal | CharClass | Empty):
            return expr
        self.state.anon += 1
        name = f"__ANON_{self.state.anon}"
        self.state.defs[name] = Definition(name, expr, self.tok.pos, True)
        return Ref(name)


def _import_common(
    state: LarkDefinitions, item: str, alias: str, error: Callable[[str], GrammarSyntaxError]
) -> None:
    """Copy common terminal ``item`` (as ``alias``) and its dependencies (namespaced) into ``state``."""
    lib = LarkDefinitions()
    LarkParser(COMMON_LARK, lib).parse()
    if item not in lib.defs or item.startswith("_"):
        available = ", ".join(n for n in lib.defs if not n.startswith("_"))
        raise error(f"common.{item} is not available; supported: {available}")
    todo, seen = [item], {item}
    while todo:
        name = todo.pop()
        target = alias if name == item else f"common__{name}"
        if target in state.defs:
            if name == item:
                raise error(f"{alias!r} is already defined")
            continue
        deps = {n.name for n in walk(lib.defs[name].expr) if isinstance(n, Ref)}
        mapping = {d: (alias if d == item else f"common__{d}") for d in deps}
        state.defs[target] = Definition(target, _rename(lib.defs[name].expr, mapping), -1, True)
        todo.extend(d for d in deps if d not in seen)
        seen.update(deps)


def _rename(expr: Expr, mapping: dict[str, str]) -> Expr:
    if isinstance(expr, Ref):
        return Ref(mapping.get(expr.name, expr.name))
    if isinstance(expr, Seq | Alt):
        return type(expr)(tuple(_rename(e, mapping) for e in expr.items))
    if isinstance(expr, Repeat):
        return Repeat(_rename(expr.item, mapping), expr.min, expr.max)
    return expr
