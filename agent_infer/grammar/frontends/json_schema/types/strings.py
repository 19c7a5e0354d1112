"""JSON strings under ``minLength``/``maxLength``/``pattern``/``format`` (and the excluded values and
patterns a ``not`` leaves): the cheapest exact form first (one encoded expression, a bound moved into
the pattern, a constraint another implies dropped), else the product automaton of all of them,
written once per distinct combination."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_infer.errors import (
    GrammarLimitError,
    InvalidSchemaError,
    UnsupportedSchemaError,
)
from agent_infer.grammar.automata import (
    dfa_bound_length,
    dfa_complement,
    dfa_includes,
    dfa_intersect,
    dfa_length,
    names_dfa,
)
from agent_infer.grammar.frontends.json_schema.types.automaton_rules import dfa_to_rules
from agent_infer.grammar.frontends.json_schema.types.bounds import count
from agent_infer.grammar.frontends.json_schema.types.format_prefixes import literal_prefixes, prefixed_format
from agent_infer.grammar.frontends.json_schema.types.formats import (
    FORMAT_MAX_LENGTH,
    SPEC_FORMATS,
    encoded_format,
    format_dfa,
    format_expr,
)
from agent_infer.grammar.frontends.json_schema.types.lengths import bounded_pattern, bounded_rules
from agent_infer.grammar.frontends.json_schema.types.patterns import pattern_search, string_patterns
from agent_infer.grammar.frontends.json_schema.types.string_encoding import HIGH_EXPR, HIGH_RULE, encode_expr
from agent_infer.grammar.ir import Alt, BoundedString, Expr, Ref, Repeat, Seq, alt, lit, seq

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler

# String characters repeat inline up to this count (other items: Compiler.repeat's default):
# one chain of positions, whose masks the native cache shares across positions (short-token
# masks), instead of doubling rules whose block ends make most tokens uncertain. About 35
# automaton states per position.
MAX_INLINE_CHAR_REPEAT = 256
# The native compiler keeps rules with longer counted repeats out of their callers (kMaxInlineRepeat
# in grammar/lower/compile.cpp).
_MAX_INLINED_REPEAT = 32


def string_body(c: Compiler, flat: dict[str, Any], pointer: str) -> Expr | None:
    """The JSON text between the quotes, or None if the string constraints were all dropped."""
    lo = count(flat, "minLength", pointer) or 0
    hi = count(flat, "maxLength", pointer)
    if hi is not None and hi < lo:
        return None
    pats = string_patterns(flat, pointer)
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
        fmt_expr = format_expr(fmt)
        if fmt_expr is None and fmt in SPEC_FORMATS:
            c.unsupported("format", f"{pointer}/format", f"format {fmt!r} is not supported")
        elif fmt_expr is None:
            c.unknown_format(fmt, f"{pointer}/format")
    # Complements from `not` (see applicators/negate.py): excluded values and patterns.
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
        return encoded_format(fmt_name)
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
            return encoded_format(fmt_name)
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
        dfas.append(format_dfa(fmt_name))
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
            dfas.append(format_dfa(fmt_name))
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


def lower_string(c: Compiler, flat: dict[str, Any], pointer: str) -> Expr:
    """A JSON string under minLength/maxLength/pattern/format."""
    implied = FORMAT_MAX_LENGTH.get(flat.get("format"))  # type: ignore[arg-type]
    if implied is not None:
        hi = count(flat, "maxLength", pointer)
        if hi is None or hi > implied:
            flat = {**flat, "maxLength": implied}
    try:
        body = string_body(c, flat, pointer)
    except GrammarLimitError:
        # Usually the product of a pattern's or format's automaton and a long maxLength: the
        # matcher counts the length instead, over the automaton without the bound.
        counted = _length_at_run_time(c, flat, pointer)
        if counted is None:
            raise
        return counted
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


def _length_at_run_time(c: Compiler, flat: dict[str, Any], pointer: str) -> Expr | None:
    """The string as a :class:`BoundedString` rule (the constraints but ``maxLength`` as an
    expression, ``maxLength`` counted by the matcher), or None when there is no ``maxLength``, or
    the rest still exceeds a limit or is not one expression (a product automaton's rules)."""
    hi = count(flat, "maxLength", pointer)
    if hi is None:
        return None
    rest = {k: v for k, v in flat.items() if k != "maxLength"}
    try:
        body = string_body(c, rest, pointer)
    except GrammarLimitError:
        return None
    if body is None:
        return None
    expr = _inline_high(body, {})
    if expr is None:
        return None
    return c.shared_rule("string-counted", BoundedString(seq(lit('"'), expr, lit('"')), hi))


def _inline_high(expr: Expr, memo: dict[int, Expr | None]) -> Expr | None:
    """``expr`` with the shared non-ASCII rule written in place (the matcher counts a bounded
    string within one automaton), or None if it calls any other rule."""
    found = memo.get(id(expr), expr)
    if found is not expr:
        return found
    out: Expr | None
    if isinstance(expr, Ref):
        out = HIGH_EXPR if expr.name == HIGH_RULE else None
    elif isinstance(expr, Seq | Alt):
        items = [_inline_high(e, memo) for e in expr.items]
        out = None if any(e is None for e in items) else type(expr)(tuple(e for e in items if e is not None))
    elif isinstance(expr, Repeat):
        item = _inline_high(expr.item, memo)
        out = None if item is None else Repeat(item, expr.min, expr.max)
    else:
        out = expr if not expr.children() else None
    memo[id(expr)] = out
    return out
