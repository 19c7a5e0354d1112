"""Objects, arrays and enum/const values for the JSON Schema compiler.

Property order policy: declared ``properties`` come first, in declared order, each optional one
may be skipped; then required-but-undeclared names (in ``required`` order); then any number of
additional members (keys outside the declared set, split into ``patternProperties`` regions).
Counting states (for ``minProperties``/``maxProperties``) are rules ``(position, count)``.
"""

from __future__ import annotations

import itertools
import json
from typing import TYPE_CHECKING, Any

from agent_infer.grammar.automata.dfa import (
    DFA,
    dfa_accepts,
    dfa_complement,
    dfa_intersect,
    dfa_is_empty,
    dfa_length,
    dfa_to_rules,
    expr_to_dfa,
)
from agent_infer.grammar.frontends.json_schema import numbers as num
from agent_infer.grammar.frontends.json_schema.formats import FORMATS
from agent_infer.grammar.frontends.json_schema.members import cat, counted_members, member_list, seq_items
from agent_infer.grammar.frontends.json_schema.merge import canon, is_annotation, to_fraction, type_set
from agent_infer.grammar.frontends.json_schema.names import names_dfa
from agent_infer.grammar.frontends.json_schema.resolve import schema_text
from agent_infer.grammar.frontends.json_schema.scalars import count
from agent_infer.grammar.frontends.json_schema.text import encode_expr, encode_literal
from agent_infer.grammar.ir import Alt, Empty, Expr, Literal, Ref, alt, lit, opt, seq, star

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.entry import Compiler

MAX_PATTERN_REGIONS = 3
MAX_PERMUTED = 3


def _never() -> Expr:
    return Alt(())


def _all_of(*schemas: Any) -> Any:
    real = [s for s in schemas if s is not True and s != {}]
    if not real:
        return True
    return real[0] if len(real) == 1 else {"allOf": real}


# -- enum / const ---------------------------------------------------------------------------------


def value_expr(c: Compiler, v: Any, depth: int) -> Expr:
    """JSON texts equal to ``v`` (numbers in any fraction form, small objects in any key order)."""
    if v is None:
        return lit("null")
    if isinstance(v, bool):
        return lit("true" if v else "false")
    if isinstance(v, int | float):
        f = to_fraction(v)
        return num.bounded_number(f, False, f, False, False) or lit(json.dumps(v))
    if isinstance(v, str):
        return _string_value(v)
    if isinstance(v, list):
        if not v:
            return c.empty("[", "]")
        items = [value_expr(c, x, depth + 1) for x in v]
        body = seq(items[0], *(seq(c.sep(depth), x) for x in items[1:]))
        return c.container("[", "]", body, False, depth)
    if isinstance(v, dict):
        if not v:
            return c.empty("{", "}")
        members = [
            seq(lit('"'), encode_literal(k), lit('"'), c.colon(), value_expr(c, x, depth + 1))
            for k, x in v.items()
        ]
        orders = itertools.permutations(members) if len(members) <= 3 else [members]
        bodies = [seq(o[0], *(seq(c.sep(depth), m) for m in o[1:])) for o in orders]
        return c.container("{", "}", alt(*bodies), False, depth)
    raise TypeError(f"not a JSON value: {v!r}")


def lower_values(
    c: Compiler, vals: list[Any], flat: dict[str, Any], pointer: str, depth: int, *, own_enum: bool = False
) -> Expr:
    """enum/const: the listed values that also satisfy every sibling keyword (decided per value).
    ``own_enum``: ``vals`` is ``flat``'s own ``enum`` (no ``const``), so membership is given."""
    from agent_infer.grammar.frontends.json_schema.values import value_predicate

    valid = value_predicate(c, flat, pointer, own_enum=own_enum)
    keep = []
    seen = set()
    strings = True
    for v in vals:
        # Strings are their own key (canon's keys are tuples, never equal to a str): generated
        # enums list thousands of codes.
        key = v if type(v) is str else canon(v)
        if key not in seen:
            seen.add(key)
            if valid(v):
                keep.append(v)
                strings = strings and type(v) is str
    if not keep:
        return _never()
    if strings:
        # Distinct strings have distinct encodings, and none is an alternation: alt() would find
        # nothing to flatten or drop, only hash every value's expression to be sure.
        exprs = [_string_value(v) for v in keep]
        return exprs[0] if len(exprs) == 1 else Alt(tuple(exprs))
    numbers = [v for v in keep if type(v) is int or type(v) is float]
    if len(numbers) < 2:
        return alt(*(value_expr(c, v, depth) for v in keep))
    rest = [value_expr(c, v, depth) for v in keep if not (type(v) is int or type(v) is float)]
    return alt(num.listed_numbers([to_fraction(v) for v in numbers], [json.dumps(v) for v in numbers]), *rest)


def _string_value(v: str) -> Expr:
    """``value_expr`` of a string; printable ASCII is one literal with its quotes."""
    if v.isascii() and v.isprintable() and '"' not in v and "\\" not in v and "/" not in v:
        return Literal(f'"{v}"')
    return seq(lit('"'), encode_literal(v), lit('"'))


# -- objects ----------------------------------------------------------------------------------------


def _key_language(c: Compiler, pn: Any, pointer: str) -> DFA | bool:
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
        else:
            c.unsupported("propertyNames", f"{pointer}/{key}", f"propertyNames with {key!r} is not supported")
    if not dfas:
        return True
    out = dfas[0]
    for d in dfas[1:]:
        out = dfa_intersect(out, d)
    return out


def _key_expr(c: Compiler, dfa: DFA | None, hint: str) -> Expr:
    """A quoted JSON key from a decoded-key DFA (None: any key)."""
    if dfa is None:
        return seq(lit('"'), star(c.char), lit('"'))
    name = c.fresh(hint)
    start, rules = dfa_to_rules(dfa, name + "-")
    for rule_name, expr in rules:
        c.rules[rule_name] = expr
    c.rules[name] = start
    return seq(lit('"'), Ref(name), lit('"'))


def _names_complement_key(c: Compiler, names: list[str]) -> Expr:
    """``_key_expr(c, dfa_complement(names_dfa(names)), ...)`` (that language is never empty), its
    trie nodes shared with every other object's (:class:`ComplementKeys`)."""
    return seq(lit('"'), c.complement_keys.start(names), lit('"'))


def lower_object(c: Compiler, flat: dict[str, Any], pointer: str, depth: int) -> Expr:
    """An object under properties/required/additional/pattern properties/propertyNames/counts."""
    props = flat.get("properties", {})
    pats = flat.get("patternProperties", {})
    required = flat.get("required", [])
    if not isinstance(props, dict) or not isinstance(pats, dict):
        raise _invalid("properties/patternProperties must be objects", pointer)
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        from agent_infer.errors import InvalidSchemaError

        raise InvalidSchemaError("required must be an array of strings", pointer=f"{pointer}/required")
    additional = flat.get("additionalProperties", flat.get("unevaluatedProperties", True))
    lo = count(flat, "minProperties", pointer) or 0
    hi = count(flat, "maxProperties", pointer)
    keys = _key_language(c, flat.get("propertyNames", True), f"{pointer}/propertyNames")

    def key_ok(name: str) -> bool:
        return keys is True or (isinstance(keys, DFA) and dfa_accepts(keys, name))

    def schema_for(name: str) -> Any:
        if not pats and name in props:
            v = props[name]
            return True if v is True or v == {} else v  # _all_of(v)
        hits = [
            v for p, v in pats.items() if dfa_accepts(c.pattern_dfa(p, f"{pointer}/patternProperties"), name)
        ]
        if name in props:
            return _all_of(props[name], *hits)
        return _all_of(*hits) if hits else additional

    names = list(props) + [r for r in dict.fromkeys(required) if r not in props]
    members: list[tuple[Expr, bool]] = []
    required_set = set(required)
    for name in names:
        schema = schema_for(name) if keys is True or key_ok(name) else False
        is_required = name in required_set
        if schema is False:
            if is_required:
                return _never()
            continue
        here = f"{pointer}/properties/{name}" if name in props else f"{pointer}/required"
        value = c.lower(schema, here, depth + 1)
        members.append((cat((*seq_items(_quoted_key(c, name)), *seq_items(value))), is_required))
    extra = _extra_member(c, flat, pointer, depth, names, pats, additional, keys)
    undeclared = len(names) - len(props)  # all present in members: a missing one returned above
    if lo == 0 and hi is None and 2 <= undeclared <= MAX_PERMUTED:
        # Required-but-undeclared names have no declared order: accept any order of them.
        head, tail = members[:-undeclared], members[-undeclared:]
        bodies = [member_list(c, head + list(p), extra, depth)[0] for p in itertools.permutations(tail)]
        return c.container("{", "}", alt(*(b for b in bodies if b is not None)), False, depth)
    if lo == 0 and hi is None:
        body, nullable = member_list(c, members, extra, depth)
        return c.container("{", "}", body, nullable, depth) if body is not None else c.empty("{", "}")
    return counted_members(c, members, extra, lo, hi, depth, pointer)


def _quoted_key(c: Compiler, name: str) -> Expr:
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


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


def _invalid(msg: str, pointer: str) -> Exception:
    from agent_infer.errors import InvalidSchemaError

    return InvalidSchemaError(msg, pointer=pointer)


def _same_schema(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same schema as written (``true`` and ``{}`` alike)."""
    if a is True or a == {}:
        return b is True or b == {}
    return a == b


def _extra_member(
    c: Compiler,
    flat: dict[str, Any],
    pointer: str,
    depth: int,
    names: list[str],
    pats: dict[str, Any],
    additional: Any,
    keys: DFA | bool,
) -> Expr | None:
    """One additional member (``"key": value``) over keys outside ``names``, or None if none allowed."""
    if keys is False:
        return None
    if pats and all(_same_schema(v, additional) for v in pats.values()):
        # Every region's value schema is additionalProperties' (``{"^.{1,255}$": {}}`` next to the
        # default true): one region, any undeclared key, without an automaton per pattern. The
        # patterns are still parsed, so a bad one is reported as before.
        for p in pats:
            c.pattern_expr(p, f"{pointer}/patternProperties")
        pats = {}
    if len(pats) > MAX_PATTERN_REGIONS:
        c.unsupported("patternProperties", f"{pointer}/patternProperties", "too many patternProperties")
        pats = {}
    pn = schema_text(flat["propertyNames"], sort_keys=True) if "propertyNames" in flat else "true"
    sorted_names = tuple(sorted(names))
    if keys is True and not pats:
        # The common case (one region: any key but the declared names), as the loop below does it.
        if additional is False:
            return None
        cache_key: tuple[Any, ...] = (sorted_names, (), (), pn)
        key = c.key_cache.get(cache_key)
        if key is None:
            key = c.key_cache[cache_key] = (
                _names_complement_key(c, names) if names else _key_expr(c, None, f"{pointer}-key")
            )
        value = c.lower(additional, f"{pointer}/additionalProperties", depth + 1)
        return Ref(c.add_rule(f"{pointer}-member", seq(key, c.colon(), value)))
    pat_names = tuple(pats)
    here_pats = f"{pointer}/patternProperties"

    def pattern_dfa(p: str) -> DFA:
        return c.pattern_dfa(p, here_pats)  # cached per pattern by the compiler

    # Per declared name, which patterns it matches: a region (a choice of matched patterns) only
    # has to exclude the names that fall in it. Most regions hold none of them (a name matches
    # its object's catch-all pattern, so it lies outside the "no pattern" region), and then the
    # key automaton needs no product with the names' complement.
    name_masks = (
        {tuple(dfa_accepts(pattern_dfa(p), n) for p in pat_names) for n in names} if names and pats else set()
    )
    base_cache: dict[bool, DFA | None] = {}

    def base(exclude_names: bool) -> DFA | None:
        if exclude_names not in base_cache:
            dfa = dfa_complement(names_dfa(names)) if names and exclude_names else None
            if isinstance(keys, DFA):
                dfa = keys if dfa is None else dfa_intersect(dfa, keys)
            base_cache[exclude_names] = dfa
        return base_cache[exclude_names]

    out: list[Expr] = []
    for mask in itertools.product((False, True), repeat=len(pats)):
        chosen = [p for p, m in zip(pats, mask) if m]
        value_schema = _all_of(*(pats[p] for p in chosen)) if chosen else additional
        if value_schema is False:
            continue
        # Objects that share declared names share the key automaton's rules.
        cache_key = (sorted_names, pat_names, mask, pn)
        if cache_key not in c.key_cache and names and keys is True and not pats:
            # The common case, "any key but the declared names": rules read off the names' trie.
            c.key_cache[cache_key] = _names_complement_key(c, names)
        if cache_key not in c.key_cache and mask == (True,) and keys is True:
            # Keys matching the one pattern: unless a declared name matches it too (those keys
            # belong to their own members), that is the pattern's search expression, encoded as a
            # string value's pattern is and lowered natively, with no automaton built in Python.
            p = pat_names[0]
            if mask not in name_masks:
                body = encode_expr(c.pattern_expr(p, here_pats))
                c.key_cache[cache_key] = seq(lit('"'), Ref(c.add_rule(f"{pointer}-key", body)), lit('"'))
        if cache_key not in c.key_cache:
            dfa = base(not pats or mask in name_masks)
            for p, m in zip(pats, mask):
                d = pattern_dfa(p) if m else dfa_complement(pattern_dfa(p))
                dfa = d if dfa is None else dfa_intersect(dfa, d)
            empty = dfa is not None and dfa_is_empty(dfa)
            c.key_cache[cache_key] = None if empty else _key_expr(c, dfa, f"{pointer}-key")
        key = c.key_cache[cache_key]
        if key is None:
            continue
        here = (
            f"{pointer}/patternProperties/{_escape(chosen[0])}"
            if chosen
            else f"{pointer}/additionalProperties"
        )
        out.append(seq(key, c.colon(), c.lower(value_schema, here, depth + 1)))
    if not out:
        return None
    name = c.add_rule(f"{pointer}-member", alt(*out))
    return Ref(name)


# -- arrays -------------------------------------------------------------------------------------------


def lower_array(c: Compiler, flat: dict[str, Any], pointer: str, depth: int) -> Expr:
    """An array under prefixItems/items/minItems/maxItems/contains/uniqueItems."""
    prefix = flat.get("prefixItems", [])
    items = flat.get("items", flat.get("unevaluatedItems", True))
    lo = count(flat, "minItems", pointer) or 0
    hi = count(flat, "maxItems", pointer)
    if items is False:
        hi = len(prefix) if hi is None else min(hi, len(prefix))
    if hi is not None and hi < lo:
        return _never()
    if flat.get("uniqueItems") is True and not (hi is not None and hi <= 1):
        c.unsupported(
            "uniqueItems", f"{pointer}/uniqueItems", "uniqueItems is only supported for maxItems <= 1"
        )
    sep = c.sep(depth)
    contains = flat.get("contains")
    min_contains = count(flat, "minContains", pointer)
    if contains is not None and min_contains == 0 and "maxContains" in flat:
        c.unsupported("maxContains", f"{pointer}/maxContains", "maxContains is not supported")
    if contains is not None and min_contains != 0:
        if prefix or "maxContains" in flat or (min_contains or 1) != 1 or lo > 1 or hi is not None:
            c.unsupported("contains", f"{pointer}/contains", "contains is only supported in its plain form")
        else:
            item = c.lower(items, f"{pointer}/items", depth + 1)
            hit = c.lower(_all_of(items, contains), f"{pointer}/contains", depth + 1)
            body = seq(star(seq(item, sep)), hit, star(seq(sep, item)))
            return c.container("[", "]", body, False, depth)
    elems = [c.lower(p, f"{pointer}/prefixItems/{i}", depth + 1) for i, p in enumerate(prefix)]
    m = len(elems)
    item_expr = c.lower(items, f"{pointer}/items", depth + 1) if items is not False else _never()
    r_min = max(0, lo - m)
    r_max = None if hi is None else max(0, hi - m)
    # rest after at least one element: more items, each preceded by a separator
    rest: Expr = (
        c.repeat(seq(sep, item_expr), r_min, r_max) if r_max != 0 else (Empty() if r_min == 0 else _never())
    )
    first_tail: Expr | None = None
    if hi == 0:
        return c.empty("[", "]")
    if m == 0:
        if r_max == 0:
            return c.empty("[", "]") if lo == 0 else _never()
        more = c.repeat(seq(sep, item_expr), max(r_min - 1, 0), None if r_max is None else r_max - 1)
        return c.container("[", "]", seq(item_expr, more), lo == 0, depth)
    for i in range(m - 1, -1, -1):
        if hi is not None and i >= hi:
            rest = Empty()
            continue
        step = seq(elems[i], rest)
        if i == 0:
            first_tail = step
        else:
            rest = seq(sep, step) if i < lo else opt(seq(sep, step))
    assert first_tail is not None
    return c.container("[", "]", first_tail, lo == 0, depth)
