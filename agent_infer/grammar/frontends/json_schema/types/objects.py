"""Objects for the JSON Schema compiler: declared members, additional members by key region, and
property counts.

Property order policy: declared ``properties`` come first, in declared order, each optional one
may be skipped; then required-but-undeclared names (in ``required`` order); then any number of
additional members (keys outside the declared set, split into ``patternProperties`` regions).
Without property counts a second order is taken too: the required members first, in the order
``required`` lists them, then the optional ones in declared order, then the additional ones.
Counting states (for ``minProperties``/``maxProperties``) are rules ``(position, count)``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from agent_infer.errors import InvalidSchemaError
from agent_infer.grammar.automata import (
    DFA,
    dfa_accepts,
    dfa_complement,
    dfa_intersect,
    dfa_is_empty,
    names_dfa,
)
from agent_infer.grammar.frontends.json_schema.applicators.merge import all_of
from agent_infer.grammar.frontends.json_schema.keys.property_names import (
    key_expr,
    key_language,
    names_complement_key,
    quoted_key,
)
from agent_infer.grammar.frontends.json_schema.resolve.keyword_checks import pointer_escape, schema_text
from agent_infer.grammar.frontends.json_schema.types.bounds import count
from agent_infer.grammar.frontends.json_schema.types.members import (
    cat,
    counted_members,
    member_list,
    members_with_hit,
    required_first,
    seq_items,
)
from agent_infer.grammar.frontends.json_schema.types.pattern_regions import (
    MAX_PATTERNS,
    MAX_REGIONS,
    needed,
    region_masks,
)
from agent_infer.grammar.frontends.json_schema.types.string_encoding import encode_expr
from agent_infer.grammar.ir import Alt, Expr, Ref, alt, lit, seq

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler

# Internal keyword: the object takes its declared order only (no required-first order). The items
# of a check are aligned to one member order (applicators/alignment.py), and a second order that
# only some items take (it depends on their ``required``) would let one item read a text another
# rejects for its order alone.
ONE_ORDER_KEY = "__one_order"

MAX_PERMUTED = 3
# Complements of additionalProperties one object must meet at once (2^n states per position).
MAX_NEEDS = 3


def _never() -> Expr:
    return Alt(())


# -- enum / const ---------------------------------------------------------------------------------


# -- objects ----------------------------------------------------------------------------------------


def lower_object(c: Compiler, flat: dict[str, Any], pointer: str, depth: int) -> Expr:
    """An object under properties/required/additional/pattern properties/propertyNames/counts."""
    props = flat.get("properties", {})
    pats = flat.get("patternProperties", {})
    required = flat.get("required", [])
    if not isinstance(props, dict) or not isinstance(pats, dict):
        raise _invalid("properties/patternProperties must be objects", pointer)
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise InvalidSchemaError("required must be an array of strings", pointer=f"{pointer}/required")
    additional = flat.get("additionalProperties", flat.get("unevaluatedProperties", True))
    lo = count(flat, "minProperties", pointer) or 0
    hi = count(flat, "maxProperties", pointer)
    keys = key_language(c, flat.get("propertyNames", True), f"{pointer}/propertyNames")

    def key_ok(name: str) -> bool:
        return keys is True or (isinstance(keys, DFA) and dfa_accepts(keys, name))

    def schema_for(name: str) -> Any:
        if not pats and name in props:
            v = props[name]
            return True if v is True or v == {} else v  # all_of(v)
        hits = [
            v for p, v in pats.items() if dfa_accepts(c.pattern_dfa(p, f"{pointer}/patternProperties"), name)
        ]
        if name in props:
            return all_of(props[name], *hits)
        return all_of(*hits) if hits else additional

    names = list(props) + [r for r in dict.fromkeys(required) if r not in props]
    members: list[tuple[Expr, bool]] = []
    kept: list[str] = []  # the names of ``members``
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
        members.append((cat((*seq_items(quoted_key(c, name)), *seq_items(value))), is_required))
        kept.append(name)
    extra = _extra_member(c, flat, pointer, depth, names, pats, additional, keys)
    if flat.get("__some_members"):
        hit_members = list(zip(kept, members))
        return _with_hit(
            c, flat, pointer, depth, names, hit_members, extra, schema_for, pats, additional, keys
        )
    undeclared = len(names) - len(props)  # all present in members: a missing one returned above
    if lo == 0 and hi is None and 2 <= undeclared <= MAX_PERMUTED:
        # Required-but-undeclared names have no declared order: accept any order of them.
        head, tail = members[:-undeclared], members[-undeclared:]
        bodies = [member_list(c, head + list(p), extra, depth)[0] for p in itertools.permutations(tail)]
        return c.container("{", "}", alt(*(b for b in bodies if b is not None)), False, depth)
    if lo == 0 and hi is None:
        body, nullable = member_list(c, members, extra, depth)
        order = None if flat.get(ONE_ORDER_KEY) else required_first(kept, required)
        if order is not None and body is not None:
            # Writers often follow ``required`` rather than ``properties``: that order is taken too.
            again, _ = member_list(c, [members[i] for i in order], extra, depth)
            if again is not None:
                body = alt(body, again)
        return c.container("{", "}", body, nullable, depth) if body is not None else c.empty("{", "}")
    return counted_members(c, members, extra, lo, hi, depth, pointer)


def _with_hit(
    c: Compiler,
    flat: dict[str, Any],
    pointer: str,
    depth: int,
    names: list[str],
    named: list[tuple[str, tuple[Expr, bool]]],
    extra: Expr | None,
    schema_for: Callable[[str], Any],
    pats: dict[str, Any],
    additional: Any,
    keys: DFA | bool,
) -> Expr:
    """An object that, for each entry of ``__some_members`` (the complement of an
    additionalProperties), has a member whose key is outside the entry's ``outside`` names and
    whose value satisfies its ``value``."""
    needs = flat["__some_members"]
    lo, hi = count(flat, "minProperties", pointer) or 0, count(flat, "maxProperties", pointer)
    # A hit is a member, so minProperties 1 holds already; other counts are not combined.
    if len(needs) > MAX_NEEDS or lo > 1 or hi is not None:
        c.unsupported(
            "additionalProperties",
            pointer,
            f"the complement of additionalProperties next to property counts or more than {MAX_NEEDS} others",
        )
        return _never()
    chosen_memo: dict[int, tuple[set[str], Any]] = {}

    def chosen(mask: int) -> tuple[set[str], Any]:
        """The names a hit for the needs in ``mask`` must avoid, and the schema its value meets."""
        if mask not in chosen_memo:
            picked = [n for j, n in enumerate(needs) if mask >> j & 1]
            avoid = {name for n in picked for name in n["outside"]}
            chosen_memo[mask] = (avoid, all_of(*(n["value"] for n in picked)))
        return chosen_memo[mask]

    def member_hit(i: int, mask: int) -> Expr | None:
        name = named[i][0]
        avoid, value = chosen(mask)
        hit_schema = all_of(schema_for(name), value) if name not in avoid else False
        if hit_schema is False:
            return None
        value_expr = c.lower(hit_schema, f"{pointer}/properties/{pointer_escape(name)}", depth + 1)
        return cat((*seq_items(quoted_key(c, name)), *seq_items(value_expr)))

    def extra_hit(mask: int) -> Expr | None:
        avoid, value = chosen(mask)
        wider = names + sorted(n for n in avoid if n not in names)
        region_values = {p: all_of(v, value) for p, v in pats.items()}
        return _extra_member(
            c, flat, f"{pointer}-hit{mask}", depth, wider, region_values, all_of(additional, value), keys
        )

    members = [m for _, m in named]
    body = members_with_hit(c, members, member_hit, extra, extra_hit, len(needs), depth, pointer)
    return c.container("{", "}", body, False, depth)


def _invalid(msg: str, pointer: str) -> Exception:
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
        # patterns are still parsed, so a bad one is still reported.
        for p in pats:
            c.pattern_expr(p, f"{pointer}/patternProperties")
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
                names_complement_key(c, names) if names else key_expr(c, None, f"{pointer}-key")
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

    regions = region_masks(len(pat_names), lambda i: pattern_dfa(pat_names[i]))
    if regions is None:
        c.unsupported(
            "patternProperties",
            here_pats,
            f"too many patternProperties: more than {MAX_PATTERNS} patterns or {MAX_REGIONS} key regions",
        )
        # Non-strict: the patterns are dropped; every undeclared key is an additional member.
        return _extra_member(c, flat, pointer, depth, names, {}, additional, keys)
    masks, apart = regions
    out: list[Expr] = []
    for mask in masks:
        chosen = [p for p, m in zip(pats, mask) if m]
        value_schema = all_of(*(pats[p] for p in chosen)) if chosen else additional
        if value_schema is False:
            continue
        # Objects that share declared names share the key automaton's rules.
        cache_key = (sorted_names, pat_names, mask, pn)
        if cache_key not in c.key_cache and names and keys is True and not pats:
            # The common case, "any key but the declared names": rules read off the names' trie.
            c.key_cache[cache_key] = names_complement_key(c, names)
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
            for q, (p, m) in enumerate(zip(pats, mask)):
                if not m and not needed(mask, q, apart):
                    continue
                d = pattern_dfa(p) if m else dfa_complement(pattern_dfa(p))
                dfa = d if dfa is None else dfa_intersect(dfa, d)
            empty = dfa is not None and dfa_is_empty(dfa)
            c.key_cache[cache_key] = None if empty else key_expr(c, dfa, f"{pointer}-key")
        key = c.key_cache[cache_key]
        if key is None:
            continue
        here = (
            f"{pointer}/patternProperties/{pointer_escape(chosen[0])}"
            if chosen
            else f"{pointer}/additionalProperties"
        )
        out.append(seq(key, c.colon(), c.lower(value_schema, here, depth + 1)))
    if not out:
        return None
    name = c.add_rule(f"{pointer}-member", alt(*out))
    return Ref(name)


# -- arrays -------------------------------------------------------------------------------------------
