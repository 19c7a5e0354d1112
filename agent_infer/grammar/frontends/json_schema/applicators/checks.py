"""``oneOf``, ``not`` and ``allOf`` as checks (``ir.Check``) where no complement or merge can be
written.

A check keeps a value only when the set of its item schemas whose grammars accept it is an
accepted one: exactly one branch for ``oneOf`` (``Check(B1..Bn, carriers=n, one-hot)``), the base
and not the negated schema for ``not`` (``Check((S, N), carriers=1, (0b01,))``), every part for
``allOf``. The grammars decide membership, so a verdict is exact only where a grammar that judges
a text another item wrote rejects it exactly when the schema does: the items are aligned first
(:mod:`.alignment`), and a ``oneOf`` or ``not`` that cannot be aligned stays unsupported.

The check is compiled to one automaton of its items (``product``), which never keeps a prefix no
accepted value completes, whatever the overlap, so no proof about dead prefixes is needed. Parts
the items share (one rule: a free JSON value, a common definition, recursive or not) stay
references in it; the compiler raises GrammarLimitError, naming the check's rule, when the
automaton passes its state limit (docs/grammar_engine.md, "Run-time checks").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_infer.errors import UnsupportedSchemaError
from agent_infer.grammar.frontends.json_schema.applicators.alignment import ALIGNED_KEY, align_family
from agent_infer.grammar.frontends.json_schema.applicators.exclusivity import pairwise_disjoint
from agent_infer.grammar.ir import MAX_CHECK_ITEMS, Alt, Check, Expr, Ref, alt

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler


def one_of_check(
    c: Compiler, branches: list[Any], pointer: str, depth: int, single: list[bool] | None = None
) -> Expr | None:
    """``oneOf`` of the flattened ``branches`` as a product check, or None when it cannot be made
    exact (too many branches, items that would not judge each other's texts). ``single[i]``
    false: branch i stood for two equal branches, so a value in it is in two and never valid."""
    if single is None:
        single = [True] * len(branches)
    if not 2 <= len(branches) <= MAX_CHECK_ITEMS or False in branches:
        return None
    aligned = align_family(c, branches, pointer, 0)
    if aligned is None:
        return None
    accept = tuple(1 << i for i, alone in enumerate(single) if alone)
    return _check(c, aligned, len(aligned), accept, pointer, depth, "oneOf")


def all_of_check(c: Compiler, parts: list[Any], pointer: str, depth: int) -> Expr | None:
    """``allOf`` of ``parts`` that no keyword-by-keyword merge joins (``{"__all_of": parts}``,
    Compiler.merge) as a product check: the first part scans, every part must hold. Every grammar
    only accepts here, and accepts only valid texts, so the check is sound as it is; the parts are
    still aligned where they can be (one member order), or parts that order the same members
    differently would share no text at all. None past MAX_CHECK_ITEMS parts."""
    live = [p for p in parts if p is not True and p != {}]
    if any(p is False for p in live):
        return _empty(c, pointer)
    if not live or len(live) > MAX_CHECK_ITEMS:
        return None
    if len(live) == 1:
        return c.lower(live[0], pointer, depth)
    aligned = align_family(c, live, pointer, 0, exact=False) or live
    return _check(c, aligned, 1, ((1 << len(aligned)) - 1,), pointer, depth, "allOf")


def _empty(c: Compiler, pointer: str) -> Ref:
    name = c.fresh(f"{pointer}-empty")
    c.rules[name] = Alt(())
    return Ref(name)


def not_check(c: Compiler, base: Any, negated: Any, pointer: str, depth: int) -> Expr | None:
    """``base and not negated`` as a product check, or None (as :func:`one_of_check`)."""
    aligned = align_family(c, [base, c.flatten(negated, f"{pointer}/not")], pointer, 0)
    if aligned is None:
        return None
    return _check(c, aligned, 1, (0b01,), pointer, depth, "not")


def _check(
    c: Compiler, items: list[Any], carriers: int, accept: tuple[int, ...], pointer: str, depth: int, what: str
) -> Expr:
    refs: list[Ref] = []
    for i, item in enumerate(items):
        lowered = c.lower(item, f"{pointer}/{what}/{i}" if what == "oneOf" else pointer, depth)
        # An empty branch (Alt(())): a rule matching nothing.
        refs.append(lowered if isinstance(lowered, Ref) else _empty(c, pointer))
    name = c.fresh(f"{pointer}-{what}")
    c.rules[name] = Check(tuple(refs), carriers, accept, True)
    return Ref(name)


def lower_aligned(c: Compiler, flat: dict[str, Any], pointer: str, depth: int) -> Expr:
    """A ``oneOf`` or ``not`` member of an aligned family (:func:`_rebuilt`), possibly merged with
    other aligned schemas since: disjoint ``oneOf`` branches as an alternation, else a check."""
    rest = {k: v for k, v in flat.items() if k not in ("oneOf", "not", ALIGNED_KEY)}
    if any(k in rest for k in ("anyOf", "__more_one_of", "__conditionals", "__all_of")) or (
        "oneOf" in flat and "not" in flat
    ):
        raise UnsupportedSchemaError(
            "an aligned oneOf/not merged with other logic", keyword="oneOf", pointer=pointer
        )
    if "not" in flat:
        return _check(c, [rest, flat["not"]], 1, (0b01,), pointer, depth, "not")
    branches = [c.merge(rest, b, pointer) for b in flat["oneOf"]] if rest else list(flat["oneOf"])
    if pairwise_disjoint(c, [c.flatten(b, pointer) for b in branches]):
        return alt(*(c.lower(b, pointer, depth) for b in branches))
    if len(branches) > MAX_CHECK_ITEMS:
        raise UnsupportedSchemaError(
            f"an aligned oneOf of more than {MAX_CHECK_ITEMS} branches", keyword="oneOf", pointer=pointer
        )
    return _check(
        c, branches, len(branches), tuple(1 << i for i in range(len(branches))), pointer, depth, "oneOf"
    )
