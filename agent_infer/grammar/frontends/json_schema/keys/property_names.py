"""Property names of one object as grammar: ``propertyNames`` as an automaton over decoded keys,
a key automaton written as a quoted JSON key, "any key but the declared names" from the shared
key tries, and each declared name quoted with its colon."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_infer.grammar.automata import DFA, dfa_intersect, dfa_length, expr_to_dfa, names_dfa
from agent_infer.grammar.frontends.json_schema.keywords import KNOWN, is_annotation, type_set
from agent_infer.grammar.frontends.json_schema.types.automaton_rules import dfa_to_rules
from agent_infer.grammar.frontends.json_schema.types.bounds import count
from agent_infer.grammar.frontends.json_schema.types.formats import FORMAT_MAX_LENGTH, FORMATS, SPEC_FORMATS
from agent_infer.grammar.frontends.json_schema.types.string_encoding import encode_literal
from agent_infer.grammar.ir import Expr, Literal, Ref, lit, seq, star

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler


def key_language(c: Compiler, pn: Any, pointer: str) -> DFA | bool:
    """propertyNames as a DFA; True = unconstrained, False = no key allowed."""
    flat = c.flatten(pn, pointer)
    if flat is True or flat == {}:
        return True
    if flat is False:
        return False
    types = type_set(flat)
    if types is not None and "string" not in types:
        return False
    dfas: list[DFA] = []
    for key, v in flat.items():
        if is_annotation(key) or key == "type":
            continue
        if key == "pattern":
            pats = v["__patterns"] if isinstance(v, dict) else [v]
            dfas += [c.pattern_dfa(p, f"{pointer}/pattern") for p in pats]
        elif key == "minLength" or (key == "maxLength" and "minLength" not in flat):
            dfas.append(dfa_length(count(flat, "minLength", pointer) or 0, count(flat, "maxLength", pointer)))
        elif key in ("enum", "const"):
            dfas.append(names_dfa([x for x in (v if key == "enum" else [v]) if isinstance(x, str)]))
        elif key == "format" and v in FORMATS:
            dfas.append(expr_to_dfa(FORMATS[v]()))
            hi = count(flat, "maxLength", pointer)
            if v in FORMAT_MAX_LENGTH and (hi is None or hi > FORMAT_MAX_LENGTH[v]):
                # The format's total length (left out of its expression) would multiply the key
                # automaton's states past the string automaton limit.
                c.unsupported(
                    "propertyNames",
                    f"{pointer}/format",
                    f"format {v!r} in propertyNames without a maxLength of at most {FORMAT_MAX_LENGTH[v]}",
                )
        elif key == "format" and isinstance(v, str) and v not in SPEC_FORMATS:
            c.unknown_format(v, f"{pointer}/format")
        elif key not in KNOWN and not key.startswith("__"):
            c.unknown_keyword(key, f"{pointer}/{key}")
        else:
            c.unsupported("propertyNames", f"{pointer}/{key}", f"propertyNames with {key!r} is not supported")
    if not dfas:
        return True
    out = dfas[0]
    for d in dfas[1:]:
        out = dfa_intersect(out, d)
    return out


def key_expr(c: Compiler, dfa: DFA | None, hint: str) -> Expr:
    """A quoted JSON key from a decoded-key DFA (None: any key)."""
    if dfa is None:
        return seq(lit('"'), star(c.char), lit('"'))
    name = c.fresh(hint)
    start, rules = dfa_to_rules(dfa, name + "-")
    for rule_name, expr in rules:
        c.rules[rule_name] = expr
    c.rules[name] = start
    return seq(lit('"'), Ref(name), lit('"'))


def names_complement_key(c: Compiler, names: list[str]) -> Expr:
    """``key_expr(c, dfa_complement(names_dfa(names)), ...)`` (that language is never empty), its
    trie nodes shared with every other object's (:class:`ComplementKeys`)."""
    return seq(lit('"'), c.complement_keys.start(names), lit('"'))


def quoted_key(c: Compiler, name: str) -> Expr:
    """``"name"`` and the key/value separator: one literal when both are plain text (most keys,
    compact layout), the same bytes in one IR node instead of four. One node per name and
    compile: generated schemas repeat their property names across many objects."""
    found = c.quoted_keys.get(name)
    if found is None:
        found = c.quoted_keys[name] = _quote_key(c, name)
    return found


def _quote_key(c: Compiler, name: str) -> Expr:
    key = encode_literal(name)
    colon = c.colon()
    if type(key) is Literal:
        quoted = f'"{key.text}"'
        if type(colon) is Literal:
            return Literal(quoted + colon.text)
        return seq(Literal(quoted), colon)
    return seq(lit('"'), key, lit('"'), colon)
