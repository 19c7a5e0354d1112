"""Logic applicators for the JSON Schema compiler: anyOf/oneOf, not, if/then/else, dependencies.

Each is lowered exactly or reported as unsupported: ``oneOf`` needs pairwise-disjoint branches
(proved, or made so by intersecting with complements), ``not`` and ``if`` need an expressible
complement (:mod:`.negate`), dependencies split into "trigger present/absent" cases.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from agent_infer.errors import GrammarLimitError, InvalidSchemaError, UnsupportedSchemaError
from agent_infer.grammar.frontends.json_schema.applicators.disjoint import disjoint, patterns_oracle
from agent_infer.grammar.frontends.json_schema.applicators.negate import negate
from agent_infer.grammar.frontends.json_schema.keywords import is_annotation, values
from agent_infer.grammar.frontends.json_schema.values.canon import canon
from agent_infer.grammar.frontends.json_schema.values.enums import lower_values
from agent_infer.grammar.frontends.json_schema.values.validation import value_valid
from agent_infer.grammar.ir import Expr, alt

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler

MAX_DEPENDENCY_TRIGGERS = 3
MAX_EXCLUSIVE_BRANCHES = 8


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


def exclusive_branches(c: Compiler, branches: list[Any], raw: list[Any], pointer: str) -> list[Any] | None:
    """oneOf branches made pairwise disjoint: unchanged if provably so, else each branch
    intersected with the complements of the (sibling-free ``raw``) branches it may overlap.
    All branches share the siblings, so ``B_i & S & not(B_j & S) == B_i & S & not B_j``.
    None if some complement is inexpressible."""
    n = len(branches)
    # disjoint_pair is symmetric (both directions of the value checks run inside): each unordered
    # pair once, which halves the pairwise checks of a wide oneOf (o360: 19 branches).
    overlaps: list[list[int]] = [[] for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            if not disjoint_pair(c, branches[i], branches[j]):
                overlaps[i].append(j)
                overlaps[j].append(i)  # rows stay ascending: j's row already holds only indices < i
    if not any(overlaps):
        return branches
    if sum(1 for row in overlaps if row) > MAX_EXCLUSIVE_BRANCHES or any(
        isinstance(b, dict) and any(k.startswith("unevaluated") for k in b) for b in branches
    ):
        return None
    negs: dict[int, Any] = {}
    for j in {j for row in overlaps for j in row}:
        neg = negate(c, raw[j], f"{pointer}/oneOf/{j}")
        if neg is None:
            return None
        negs[j] = neg
    out = []
    for i, b in enumerate(branches):
        for j in overlaps[i]:
            b = c.merge(b, c.flatten(negs[j], pointer), pointer)
        out.append(b)
    return out


def finite_superset(schema: Any, depth: int = 0) -> list[Any] | None:
    """Values that include every value ``schema`` accepts, when finitely many: its enum/const, or
    the union over a oneOf/anyOf whose branches all have one (siblings only narrow it); else None."""
    if not isinstance(schema, dict) or depth > 8:
        return None
    own = values(schema)
    if own is not None:
        return own
    for key in ("oneOf", "anyOf"):
        branches = schema.get(key)
        if isinstance(branches, list) and branches:
            out: list[Any] = []
            for b in branches:
                part = finite_superset(b, depth + 1)
                if part is None:
                    return None
                out.extend(part)
            return out
    return None


def disjoint_pair(c: Compiler, a: Any, b: Any) -> bool:
    return pairwise_disjoint(c, [a, b])


def pairwise_disjoint(c: Compiler, branches: list[Any]) -> bool:
    def flat_prop(s: Any) -> Any:
        return c.flatten(s, "")

    def values_outside(a: Any, b: Any) -> bool:
        # A finite branch is disjoint from another if the other's grammar (a superset when
        # compiled non-strictly) rejects every listed value.
        vals = finite_superset(a)
        if vals is None:
            return False
        others = finite_superset(b)
        if others is not None:
            # b accepts nothing outside this set: only the shared values need its grammar, run as
            # a recognizer per value (~1 ms each); a oneOf of string enums needs none.
            listed = {canon(x) for x in others}
            vals = [v for v in vals if canon(v) in listed]
            if not vals:
                return True
        if len(vals) > 64:
            return False
        try:
            accepts = c.value_matcher(b, "", strict=False)
            return not any(accepts(v) for v in vals)
        except (GrammarLimitError, InvalidSchemaError, UnsupportedSchemaError):
            return False

    apart = patterns_oracle(lambda p: c.pattern_dfa(p, ""))
    return all(
        disjoint(a, b, flat_prop, c.matches, 0, apart) or values_outside(a, b) or values_outside(b, a)
        for i, a in enumerate(branches)
        for b in branches[i + 1 :]
    )
