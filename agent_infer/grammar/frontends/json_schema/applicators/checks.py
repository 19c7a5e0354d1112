"""``oneOf`` and ``not`` as checks (``ir.Check``) where no complement can be written.

A check keeps a value only when the set of its item schemas whose grammars accept it is an
accepted one: exactly one branch for ``oneOf`` (``Check(B1..Bn, carriers=n, one-hot)``), the base
and not the negated schema for ``not`` (``Check((S, N), carriers=1, (0b01,))``). The grammars
decide membership, so a verdict is exact only where a grammar that judges a text another item
wrote rejects it exactly when the schema does. Two conditions make sure of that
(:func:`align_family`):

* **Member order.** Object grammars take declared properties first, in declared order, then
  required undeclared names. At every position where the items' object schemas differ, each is
  rewritten to declare the union of the names any of them declares or requires, in one order
  (first met first), a name it did not declare taking the schema it applies to it anyway
  (``additionalProperties``), so every item writes and reads members in the same order. ``patternProperties``, ``propertyNames`` and dependencies are
  not rewritten: where they appear at a differing position the ``oneOf`` stays unsupported.
* **Spellings.** Where some items constrain strings (printable ASCII unescaped) and others do
  not, the others are written constrained too (``pattern: ""``, every string: only the documented
  escaped-ASCII false negative is added). Numbers where the items differ must be integers under
  ``multipleOf`` alone (residue automata, which all read the same digit strings) or carry
  identical numeric keywords (a bound forbids exponents, ``integer`` fractions): otherwise the
  ``oneOf`` stays unsupported. A ``format`` judges strings of other formats (or of none) only
  when its grammar is exactly the format (``uuid``, ``ipv4``); the others are approximations on
  which validators differ (:func:`_formats_judge`).

Where items differ in nothing, they lower to one rule and agree by construction. Duplicate keys
are outside the contract here as everywhere (docs/json_schema.md, "Policies").

The check is compiled to one automaton of its items (``product``), which never keeps a prefix no
accepted value completes, whatever the overlap, so no proof about dead prefixes is needed. Parts
the items share (one rule: a free JSON value, a common definition, recursive or not) stay
references in it; parts that differ are followed to at most MAX_ALIGN_DEPTH levels here (so a
recursion through differing schemas is refused), and the compiler raises GrammarLimitError,
naming the check's rule, when the automaton passes its state limit (docs/grammar_engine.md,
"Run-time checks").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_infer.errors import GrammarLimitError, InvalidSchemaError, UnsupportedSchemaError
from agent_infer.grammar.frontends.json_schema.types.formats import is_unknown_format
from agent_infer.grammar.ir import MAX_CHECK_ITEMS, Alt, Check, Expr, Ref

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler

# Nesting of differing object/array schemas the alignment follows.
MAX_ALIGN_DEPTH = 8

_STRING_CONSTRAINTS = ("pattern", "format", "enum", "const", "__not_values", "__not_patterns")
_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_OBJECT_BLOCKERS = (
    "patternProperties",
    "propertyNames",
    "dependentRequired",
    "dependentSchemas",
    "unevaluatedProperties",
    "__some_members",
)
_TYPES = ("null", "boolean", "object", "array", "string", "number")
# Formats whose grammar is exactly the format (RFC 4122 text, dotted quad without leading zeros).
EXACT_FORMATS = frozenset({"uuid", "ipv4"})


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
    aligned = align_family(c, live, pointer, 0) or live
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


# -- alignment ----------------------------------------------------------------------------------


def align_family(c: Compiler, family: list[Any], pointer: str, depth: int) -> list[Any] | None:
    """``family`` (schemas at one position, each judging the texts of the others) rewritten so
    that each item's grammar rejects another's text exactly when its schema rejects the value;
    None when this cannot be ensured."""
    if depth > MAX_ALIGN_DEPTH:
        return None
    try:
        flats = [c.flatten(s, pointer) for s in family]
    except (UnsupportedSchemaError, InvalidSchemaError, GrammarLimitError):
        return None
    keys = {c.schema_keys.key(f) for f in flats}
    if len(keys) == 1:
        return list(family)  # one rule: the same grammar judges
    spread = _spread_branches(c, flats, pointer)
    if spread is None:
        return None
    if spread:
        # Members that are alternations take part branch by branch, and are rebuilt from them.
        wide: list[Any] = []
        for i, f in enumerate(flats):
            wide.extend(spread[i][1] if i in spread else [f])
        aligned = align_family(c, wide, pointer, depth + 1)
        if aligned is None:
            return None
        out: list[Any] = []
        at = 0
        for i in range(len(flats)):
            if i in spread:
                key, branches = spread[i]
                out.append({key: aligned[at : at + len(branches)]})
                at += len(branches)
            else:
                out.append(aligned[at])
                at += 1
        return out
    shapes = [_shape(f) for f in flats]
    if any(s is None for s in shapes):
        return None
    out = list(flats)
    for t in _TYPES:
        having = [i for i, shape in enumerate(shapes) if shape is not None and t in shape]
        if len(having) < 2:
            continue  # a grammar without the type rejects its values, as the schema does
        if t == "string" and not _formats_judge(flats[i] for i in having):
            return None
        if t == "string" and len({_constrained(flats[i]) for i in having}) > 1:
            # Free strings may escape any character, constrained ones not printable ASCII: the
            # free ones are written constrained too (pattern "" matches every string).
            for i in having:
                if not _constrained(flats[i]):
                    out[i] = {**flats[i], "pattern": ""} if isinstance(flats[i], dict) else {"pattern": ""}
        if t == "number" and len({_numeric(flats[i], c.numbers) for i in having}) > 1:
            return None
    objects = [i for i, shape in enumerate(shapes) if shape is not None and "object" in shape]
    if len(objects) >= 2:
        rewritten = _align_objects(c, [out[i] for i in objects], pointer, depth)
        if rewritten is None:
            return None
        for i, r in zip(objects, rewritten):
            out[i] = r
    arrays = [i for i, shape in enumerate(shapes) if shape is not None and "array" in shape]
    if len(arrays) >= 2:
        rewritten = _align_arrays(c, [out[i] for i in arrays], pointer, depth)
        if rewritten is None:
            return None
        for i, r in zip(arrays, rewritten):
            out[i] = r
    return out


def _spread_branches(c: Compiler, flats: list[Any], pointer: str) -> dict[int, tuple[str, list[Any]]] | None:
    """For each member that is an ``anyOf`` or a ``oneOf`` (its siblings merged into each branch):
    the keyword and the branches; None when a branch cannot be merged with its siblings."""
    out: dict[int, tuple[str, list[Any]]] = {}
    for i, f in enumerate(flats):
        if not isinstance(f, dict) or ("anyOf" in f) == ("oneOf" in f):
            continue
        if any(k in f for k in ("not", "__conditionals", "__more_one_of")):
            continue
        key = "anyOf" if "anyOf" in f else "oneOf"
        siblings = {k: v for k, v in f.items() if k != key}
        try:
            branches = [c.merge(siblings, c.flatten(b, pointer), pointer) for b in f[key]]
        except (UnsupportedSchemaError, InvalidSchemaError, GrammarLimitError):
            return None
        out[i] = (key, branches)
    return out


def _shape(flat: Any) -> set[str] | None:
    """The JSON types ``flat`` admits ("number" covers integers); None for a form the alignment
    does not read (branches or conditionals of its own)."""
    if flat is True:
        return set(_TYPES)
    if flat is False:
        return set()
    if not isinstance(flat, dict):
        return None
    if any(
        k in flat
        for k in ("anyOf", "oneOf", "not", "__conditionals", "__more_one_of", "__not_types", "__all_of")
    ):
        return None
    t = flat.get("type")
    if t is None:
        return set(_TYPES)
    names = set(t) if isinstance(t, list) else {t}
    if "integer" in names:
        names.add("number")
    return names & set(_TYPES)


def _formats_judge(members: Any) -> bool:
    """Whether the members' formats may judge each other's strings: all one format (or none), or
    each a format whose grammar is the format itself (``uuid``, ``ipv4``). The others are
    approximations (docs/json_schema.md, ``format``), and validators differ on them: a grammar
    that rejects a string a validator calls an email must not decide that it is none."""
    found = {
        f.get("format") if isinstance(f, dict) and not is_unknown_format(f.get("format")) else None
        for f in members
    }
    return len(found) == 1 or all(f is None or f in EXACT_FORMATS for f in found)


def _constrained(flat: Any) -> bool:
    return isinstance(flat, dict) and any(k in flat for k in _STRING_CONSTRAINTS)


def _numeric(flat: Any, numbers: str) -> tuple[Any, ...]:
    """A class of number grammars that write and read the same spellings: integers under
    ``multipleOf`` alone, and plain integers where digits are not limited (``numbers="exact"``):
    digit strings of any length, ``-0`` included (residue automata, the integer grammar);
    otherwise the numeric keywords themselves (equal keywords, one grammar)."""
    if not isinstance(flat, dict):
        return ("any",)
    t = flat.get("type")
    names = set(t) if isinstance(t, list) else ({t} if t else set())
    integer = "integer" in names and "number" not in names
    kw = tuple((k, repr(flat[k])) for k in _NUMBER_KEYWORDS if k in flat)
    listed = repr(flat.get("enum")) + repr(flat.get("const"))
    if (
        integer
        and listed == "NoneNone"
        and [k for k, _ in kw] == (["multipleOf"] if numbers != "exact" or kw else [])
    ):
        return ("residue",)
    return (integer, kw, listed)


def _align_objects(c: Compiler, objs: list[Any], pointer: str, depth: int) -> list[Any] | None:
    if any(isinstance(o, dict) and any(k in o for k in _OBJECT_BLOCKERS) for o in objs):
        return None
    # Declared names and required ones (an object grammar writes required undeclared names right
    # after the declared ones, in `required` order): all of them declared, in one order.
    names: list[str] = []
    for o in objs:
        if not isinstance(o, dict):
            continue
        for n in [*o.get("properties", {}), *o.get("required", [])]:
            if isinstance(n, str) and n not in names:
                names.append(n)
    extra = [o.get("additionalProperties", True) if isinstance(o, dict) else True for o in objs]
    columns: dict[str, list[Any]] = {}
    for n in names:
        col = [
            (o.get("properties", {}).get(n, e) if isinstance(o, dict) else True) for o, e in zip(objs, extra)
        ]
        aligned = align_family(c, col, f"{pointer}/properties/{n}", depth + 1)
        if aligned is None:
            return None
        columns[n] = aligned
    aligned_extra = align_family(c, extra, f"{pointer}/additionalProperties", depth + 1)
    if aligned_extra is None:
        return None
    out = []
    for k, o in enumerate(objs):
        base = dict(o) if isinstance(o, dict) else {}
        if names:
            base["properties"] = {n: columns[n][k] for n in names}
        if "additionalProperties" in base or aligned_extra[k] is not True:
            base["additionalProperties"] = aligned_extra[k]
        out.append(base)
    return out


def _align_arrays(c: Compiler, arrs: list[Any], pointer: str, depth: int) -> list[Any] | None:
    if any(
        isinstance(a, dict) and any(k in a for k in ("uniqueItems", "unevaluatedItems", "minContains"))
        for a in arrs
    ):
        return None
    width = max(len(a.get("prefixItems", [])) if isinstance(a, dict) else 0 for a in arrs)

    def at(a: Any, i: int) -> Any:
        if not isinstance(a, dict):
            return True
        pre = a.get("prefixItems", [])
        return pre[i] if i < len(pre) else a.get("items", True)

    if any(isinstance(a, dict) and "contains" in a for a in arrs):
        return None  # a contains schema judges items too, and is not rewritten with them
    columns = [[at(a, i) for a in arrs] for i in range(width)]
    rest = [a.get("items", True) if isinstance(a, dict) else True for a in arrs]
    aligned_cols = [align_family(c, col, f"{pointer}/prefixItems", depth + 1) for col in columns]
    aligned_rest = align_family(c, rest, f"{pointer}/items", depth + 1)
    if aligned_rest is None or any(col is None for col in aligned_cols):
        return None
    out = []
    for k, a in enumerate(arrs):
        base = dict(a) if isinstance(a, dict) else {}
        if width:
            base["prefixItems"] = [col[k] for col in aligned_cols]  # type: ignore[index]
        if "items" in base or aligned_rest[k] is not True:
            base["items"] = aligned_rest[k]
        out.append(base)
    return out
