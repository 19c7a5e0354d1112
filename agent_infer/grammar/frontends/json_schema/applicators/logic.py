"""Logic applicators for the JSON Schema compiler: anyOf/oneOf, not, if/then/else, dependencies.

Each is lowered exactly or reported as unsupported: ``oneOf`` needs pairwise-disjoint branches
(proved, or made so by intersecting with complements), ``not`` and ``if`` need an expressible
complement (:mod:`.negate`), dependencies split into "trigger present/absent" cases.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from agent_infer.errors import InvalidSchemaError
from agent_infer.grammar.frontends.json_schema.applicators.by_type import one_of_by_type
from agent_infer.grammar.frontends.json_schema.applicators.checks import not_check
from agent_infer.grammar.frontends.json_schema.applicators.exclusivity import exclusive_branches
from agent_infer.grammar.frontends.json_schema.applicators.negate import negate
from agent_infer.grammar.frontends.json_schema.keywords import is_annotation, values
from agent_infer.grammar.frontends.json_schema.values.enums import lower_values
from agent_infer.grammar.frontends.json_schema.values.validation import value_valid
from agent_infer.grammar.ir import Expr, alt

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler

MAX_DEPENDENCY_TRIGGERS = 3


def apply_not(c: Compiler, flat: dict[str, Any], pointer: str) -> dict[str, Any]:
    """Fold ``not`` into the schema when it only excludes whole types (or everything/nothing)."""
    if "not" not in flat:
        return flat
    out = {k: v for k, v in flat.items() if k != "not"}
    neg = c.flatten(flat["not"], f"{pointer}/not")
    if neg is True or neg == {}:
        out["type"] = []
        return out
    if neg is False:
        return out
    banned = banned_types(c, neg)
    if banned is not None:
        out["__not_types"] = banned
        return out
    c.unsupported("not", f"{pointer}/not", "this `not` has no expressible complement")
    return out


def not_as_check(c: Compiler, flat: dict[str, Any], pointer: str, depth: int) -> Expr | None:
    """``not`` with no written complement as a check compiled to one automaton (:mod:`.checks`);
    None where :func:`apply_not` or :func:`rewrite_logic` lowers it, or the check cannot be exact."""
    if "not" not in flat or flat.get("__conditionals") or any(k.startswith("unevaluated") for k in flat):
        return None
    target = c.flatten(flat["not"], f"{pointer}/not")
    if isinstance(target, bool) or target == {} or banned_types(c, target) is not None:
        return None
    # Called where rewrite_logic found no complement for it (the lowering's order).
    base = {k: v for k, v in flat.items() if k != "not"}
    return not_check(c, base, target, pointer, depth)


def banned_types(c: Compiler, neg: Any) -> list[str] | None:
    """Types excluded by ``not: neg`` when ``neg`` only names whole types (possibly via anyOf)."""
    if not isinstance(neg, dict):
        return None
    keys = [k for k in neg if not is_annotation(k)]
    if keys == ["type"]:
        t = neg["type"]
        return list(t) if isinstance(t, list) else [t]
    if keys == ["anyOf"]:
        out: list[str] = []
        for branch in neg["anyOf"]:
            sub = banned_types(c, c.flatten(branch, ""))
            if sub is None:
                return None
            out += sub
        return out
    return None


def rewrite_logic(c: Compiler, flat: dict[str, Any], pointer: str) -> Any | None:
    """``if``/``then``/``else`` and general ``not`` as ``anyOf`` of complements, when expressible."""
    if "not" not in flat and not flat.get("__conditionals"):
        return None  # nothing to rewrite (the common case)
    if any(k.startswith("unevaluated") for k in flat):
        return None  # rewriting would change which properties/items count as evaluated
    if flat.get("__conditionals"):
        cond, *others = flat["__conditionals"]
        neg = negate(c, cond["if"], f"{pointer}/if")
        if neg is None:
            return None
        base = {k: v for k, v in flat.items() if k != "__conditionals"}
        if others:
            base["__conditionals"] = others
        # Spread the complement's own anyOf so its properties keep their place before else's.
        negs = neg["anyOf"] if isinstance(neg, dict) and list(neg) == ["anyOf"] else [neg]
        cases = [{"allOf": [cond["if"], cond["then"]]}]
        cases += [{"allOf": [n, cond["else"]]} for n in negs]
        return c.merge(base, {"anyOf": cases}, pointer)
    if "not" in flat:
        target = c.flatten(flat["not"], f"{pointer}/not")
        if isinstance(target, bool) or target == {} or banned_types(c, target) is not None:
            return None  # apply_not folds these into the type set
        neg = negate(c, target, f"{pointer}/not")
        if neg is None:
            return None
        base = {k: v for k, v in flat.items() if k != "not"}
        return c.merge(base, neg, pointer)
    return None


def check_conditionals(c: Compiler, flat: dict[str, Any], pointer: str) -> None:
    """if/then/else and other keywords without an exact CFG lowering."""
    if flat.get("__conditionals"):
        c.unsupported("if", f"{pointer}/if", "this `if` has no expressible complement")
    for key in ("$dynamicRef", "$recursiveRef"):
        if key in flat:
            c.unsupported(key, f"{pointer}/{key}", f"{key} is not supported")


def lower_branches(c: Compiler, flat: dict[str, Any], pointer: str, depth: int) -> Expr:
    """anyOf/oneOf: distribute the sibling keywords into each branch, then alternate."""
    # Next to an anyOf, a oneOf is a sibling keyword like any other: it goes into each anyOf
    # branch and is lowered there.
    both = "anyOf" in flat and "oneOf" in flat
    base = {k: v for k, v in flat.items() if k != "anyOf" and (both or k != "oneOf")}
    trivial_base = all(is_annotation(k) for k in base)
    out: list[Expr] = []
    for key in ("anyOf", "oneOf"):
        if key not in flat:
            continue
        if not isinstance(flat[key], list) or not flat[key]:
            raise InvalidSchemaError(f"{key} must be a non-empty array", pointer=f"{pointer}/{key}")
        if both and key == "oneOf":
            continue
        branches = flat[key]
        here = [f"{pointer}/{key}/{i}" for i in range(len(branches))]
        raw = [c.flatten(b, p) for b, p in zip(branches, here)]
        merged = raw
        if not trivial_base:
            if any(isinstance(m, dict) and any(k.startswith("unevaluated") for k in m) for m in merged):
                c.unsupported("unevaluatedProperties", f"{pointer}/{key}", "unevaluated* inside a branch")
            merged = [c.merge(base, m, pointer) for m in merged]
        if key == "oneOf" and all(isinstance(m, dict) and values(m) is not None for m in merged):
            return _finite_one_of(c, merged, pointer, depth)
        if key == "oneOf":
            exclusive = exclusive_branches(c, merged, raw, pointer)
            if exclusive is None:
                by_type = one_of_by_type(c, merged, raw, pointer, depth)
                if by_type is not None:
                    return by_type
                c.unsupported("oneOf", f"{pointer}/oneOf", "oneOf branches are not provably disjoint")
            elif exclusive is not merged:
                merged, trivial_base = exclusive, False
        exprs = [c.lower(b if trivial_base else m, p, depth) for b, m, p in zip(branches, merged, here)]
        out.append(alt(*exprs))
    return out[0]


def lower_dependencies(c: Compiler, flat: dict[str, Any], pointer: str, depth: int) -> Expr:
    """dependentRequired/dependentSchemas as an alternation over which triggers are present.

    Each case pins every trigger as present (with its dependencies) or absent (``false``), so the
    cases are disjoint objects and each is an ordinary schema.
    """
    deps = flat.get("dependentRequired", {})
    dschemas = flat.get("dependentSchemas", {})
    for trigger, need in deps.items():
        if not isinstance(need, list) or not all(isinstance(n, str) for n in need):
            raise InvalidSchemaError(
                "dependentRequired values must be arrays of strings",
                pointer=f"{pointer}/dependentRequired/{trigger}",
            )
    base = {k: v for k, v in flat.items() if k not in ("dependentRequired", "dependentSchemas")}
    triggers = list(dict.fromkeys([*deps, *dschemas]))
    if len(triggers) > MAX_DEPENDENCY_TRIGGERS:
        c.unsupported(
            "dependentRequired" if deps else "dependentSchemas",
            pointer,
            f"more than {MAX_DEPENDENCY_TRIGGERS} dependency triggers",
        )
        return c.lower(base, pointer, depth)
    cases: list[Expr] = []
    for mask in itertools.product((False, True), repeat=len(triggers)):
        case: Any = base
        for trigger, present in zip(triggers, mask):
            if not present:
                case = c.merge(case, {"properties": {trigger: False}}, pointer)
                continue
            case = c.merge(case, {"required": [trigger, *deps.get(trigger, [])]}, pointer)
            if trigger in dschemas:
                where = f"{pointer}/dependentSchemas/{trigger}"
                case = c.merge(case, c.flatten(dschemas[trigger], where), where)
        cases.append(c.lower(case, pointer, depth))
    return alt(*cases)


def _finite_one_of(c: Compiler, branches: list[dict[str, Any]], pointer: str, depth: int) -> Expr:
    """oneOf of listed values: the values valid under exactly one branch."""
    candidates = [v for b in branches for v in (values(b) or [])]
    keep = [
        v
        for v in candidates
        if sum(value_valid(c, b, v, f"{pointer}/oneOf/{i}") for i, b in enumerate(branches)) == 1
    ]
    return lower_values(c, keep, {}, pointer, depth)
