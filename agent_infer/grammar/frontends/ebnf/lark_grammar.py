"""Lark front end: the Lark grammar dialect to the IR (scannerless: terminals become rules).

:mod:`.lark_parser` reads the text into definitions; this module checks their references and
assembles the grammar, with an optional run of ``%ignore``d terminals before every token of a
rule (terminals are matched as they are written). Lark's lexer picks the longest match, which a
CFG cannot express; here a terminal is simply its language, so a grammar that relies on lexer
priorities may accept more strings than Lark.
"""

from __future__ import annotations

from agent_infer.errors import GrammarDefinitionError
from agent_infer.grammar.frontends.ebnf.lark_parser import LarkDefinitions, LarkParser
from agent_infer.grammar.ir import (
    Alt,
    CharClass,
    Expr,
    Grammar,
    Literal,
    Ref,
    Repeat,
    Seq,
    alt,
    seq,
    star,
)

_IGNORE = "__ignore"


def _with_ignores(expr: Expr, terminals: set[str]) -> Expr:
    """Put an optional run of ignored tokens before every token of a rule-level expression."""
    if isinstance(expr, Literal | CharClass) or (isinstance(expr, Ref) and expr.name in terminals):
        return seq(Ref(_IGNORE), expr)
    if isinstance(expr, Seq | Alt):
        return type(expr)(tuple(_with_ignores(e, terminals) for e in expr.items))
    if isinstance(expr, Repeat):
        return Repeat(_with_ignores(expr.item, terminals), expr.min, expr.max)
    return expr


def parse_lark(text: str, *, start: str = "start") -> Grammar:
    """Parse a Lark grammar into a :class:`Grammar` rooted at rule ``start``.

    Errors: GrammarSyntaxError with 1-based line/column for text that does not parse or uses an
    unsupported feature (templates, ``%declare``, non-common imports, lookaround in a regex);
    GrammarDefinitionError for undefined names or a terminal that refers to a rule.
    """
    state = LarkDefinitions()
    parser = LarkParser(text, state)
    parser.parse()
    for name, pos, in_terminal in state.refs:
        if name not in state.defs:
            where = parser.error("", pos)
            raise GrammarDefinitionError(
                f"Lark: {name!r} is used but not defined (line {where.line}, column {where.column})"
            )
        if in_terminal and not state.defs[name].terminal:
            raise parser.error(f"terminal definitions cannot refer to rule {name!r}", pos)
    if start not in state.defs or state.defs[start].terminal:
        raise GrammarDefinitionError(f"Lark start rule {start!r} is not defined")
    terminals = {d.name for d in state.defs.values() if d.terminal}
    rules: list[tuple[str, Expr]] = []
    root = start
    if state.ignores:
        root = "__start"
        rules.append((root, seq(Ref(start), Ref(_IGNORE))))
        rules.append((_IGNORE, star(alt(*state.ignores))))
    for d in state.defs.values():
        body = d.expr if d.terminal or not state.ignores else _with_ignores(d.expr, terminals)
        rules.append((d.name, body))
    return Grammar(tuple(rules), root)
