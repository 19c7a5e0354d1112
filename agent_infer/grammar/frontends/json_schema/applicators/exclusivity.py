"""``oneOf`` branches made exclusive by proof or by complements.

:func:`exclusive_branches` leaves branches proved pairwise disjoint (:mod:`.disjoint`, or listed
values another branch's grammar rejects) as they are, and intersects each branch that may overlap
others with their complements (:mod:`.negate`); None when a complement cannot be written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_infer.errors import GrammarLimitError, InvalidSchemaError, UnsupportedSchemaError
from agent_infer.grammar.frontends.json_schema.applicators.disjoint import disjoint, patterns_oracle
from agent_infer.grammar.frontends.json_schema.applicators.negate import negate
from agent_infer.grammar.frontends.json_schema.keywords import values
from agent_infer.grammar.frontends.json_schema.values.canon import canon

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler

MAX_EXCLUSIVE_BRANCHES = 8


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
