"""Alignment of the items of a check (applicators/checks.py): schemas at one position rewritten so
that each item's grammar rejects a text another item wrote exactly when its schema rejects the
value (docs/json_schema.md, "Checks").

The grammars read and write a *normal form* of JSON texts, and the rewriting makes every item
write only normal texts and judge every normal text exactly:

* **Member order.** Object grammars take declared properties first, in declared order, then
  required undeclared names. At every position where the items' object schemas differ, each is
  rewritten to declare the union of the names any of them declares or requires, in one order
  (first met first), a name it did not declare taking the schema it applies to it anyway
  (``additionalProperties``), so every item writes and reads members in the same order. Where
  an item has ``patternProperties``, a member's value is judged under the merge of the schemas
  that apply to its name, so all the schemas that can apply at that position are aligned as one
  family (:func:`_align_patterned`); names ``dependentRequired`` mentions are declared too (the
  branches dependencies lower to require them). Keys are read by automata in every item
  (printable ASCII unescaped) where one reads them so (``patternProperties``,
  ``propertyNames``). ``dependentSchemas`` and ``unevaluatedProperties`` are not rewritten: where
  they appear at a differing position the check is refused.
* **Spellings.** Where some items constrain strings (printable ASCII unescaped) and others do
  not, the others are written constrained too (``pattern: ""``, every string: only the documented
  escaped-ASCII false negative is added). Where the items' numbers differ, they are written in
  canonical spellings only (no exponent, no fraction ending in ``0``: :mod:`.canonical_numbers`),
  on which every number grammar is exact; with ``numbers="float64"`` (digit limits that differ
  by grammar) they must instead be integers under ``multipleOf`` alone (residue automata) or
  carry identical numeric keywords. Listed numbers must be listed alike in every item, and a
  listed object or array is refused where another item takes that type (an ``enum`` grammar
  reads its values in their own spellings). A ``format`` judges strings of other formats (or of
  none) only when its grammar is exactly the format (``uuid``, ``ipv4``); the others are
  approximations on which validators differ (:func:`_formats_judge`).
* **Logic inside an item.** ``anyOf``/``oneOf`` members take part branch by branch and a ``not``
  member as its base and its negated schema; a rebuilt ``oneOf`` or ``not`` is lowered by a check
  of its aligned parts (:data:`ALIGNED_KEY`), never by a complement (written from keywords, in
  other spellings).

Where items differ in nothing, they lower to one rule and agree by construction. Differing parts
are followed to at most MAX_ALIGN_DEPTH levels, so a recursion through differing schemas is
refused. Duplicate keys are outside the contract here as everywhere (docs/json_schema.md,
"Policies").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agent_infer.errors import GrammarLimitError, InvalidSchemaError, UnsupportedSchemaError
from agent_infer.grammar.frontends.json_schema.applicators.canonical_numbers import (
    canonicalized,
    may_canonicalize,
)
from agent_infer.grammar.frontends.json_schema.types.formats import is_unknown_format
from agent_infer.grammar.frontends.json_schema.types.objects import ONE_ORDER_KEY

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler

# Nesting of differing object/array schemas the alignment follows.
MAX_ALIGN_DEPTH = 8
# Marks a oneOf/not whose parts are aligned (lower_aligned).
ALIGNED_KEY = "__aligned"

_NUMBER_KEYWORDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_OBJECT_BLOCKERS = (
    "dependentSchemas",
    "unevaluatedProperties",
    "__some_members",
)
_TYPES = ("null", "boolean", "object", "array", "string", "number")
# Formats whose grammar is exactly the format (RFC 4122 text, dotted quad without leading zeros).
EXACT_FORMATS = frozenset({"uuid", "ipv4"})


def align_family(
    c: Compiler, family: list[Any], pointer: str, depth: int, *, exact: bool = True
) -> list[Any] | None:
    """``family`` (schemas at one position, each judging the texts of the others) rewritten so
    that each item's grammar rejects another's text exactly when its schema rejects the value;
    None when this cannot be ensured. ``exact=False`` (the parts of an ``allOf``, where a grammar
    that rejects more is still sound): members in one order only, no spelling rewritten."""
    if depth > MAX_ALIGN_DEPTH:
        return None
    try:
        flats = [c.flatten(s, pointer) for s in family]
    except (UnsupportedSchemaError, InvalidSchemaError, GrammarLimitError):
        return None
    keys = {c.schema_keys.key(f) for f in flats}
    if len(keys) == 1:
        return list(family)  # one rule: the same grammar judges
    spread = _spread_branches(c, flats, pointer, exact)
    if spread is None:
        return None
    if spread:
        # Members that are alternations take part branch by branch, and are rebuilt from them.
        wide: list[Any] = []
        for i, f in enumerate(flats):
            wide.extend(spread[i][1] if i in spread else [f])
        aligned = align_family(c, wide, pointer, depth + 1, exact=exact)
        if aligned is None:
            return None
        out: list[Any] = []
        at = 0
        for i in range(len(flats)):
            if i in spread:
                key, branches = spread[i]
                out.append(_rebuilt(key, aligned[at : at + len(branches)], exact))
                at += len(branches)
            else:
                out.append(aligned[at])
                at += 1
        return out
    shapes = [_shape(f) for f in flats]
    if any(s is None for s in shapes) or (exact and _listed_containers_judged(flats, shapes)):
        return None
    out = list(flats)
    for t in _TYPES if exact else ():
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
            if not may_canonicalize(c, [flats[i] for i in having]):
                return None
            for i in having:
                out[i] = canonicalized(out[i])
    objects = [i for i, shape in enumerate(shapes) if shape is not None and "object" in shape]
    if len(objects) >= 2:
        rewritten = _align_objects(c, [out[i] for i in objects], pointer, depth, exact)
        if rewritten is None:
            return None
        for i, r in zip(objects, rewritten):
            out[i] = r
    arrays = [i for i, shape in enumerate(shapes) if shape is not None and "array" in shape]
    if len(arrays) >= 2:
        rewritten = _align_arrays(c, [out[i] for i in arrays], pointer, depth, exact)
        if rewritten is None:
            return None
        for i, r in zip(arrays, rewritten):
            out[i] = r
    return out


def _rebuilt(key: str, parts: list[Any], exact: bool) -> Any:
    """A member spread by :func:`_spread_branches`, from its aligned parts. A ``oneOf`` or a
    ``not`` is marked aligned: lowered by a check of its parts as they are (:func:`lower_aligned`),
    never by a complement, whose grammar would be written from keywords, in other spellings."""
    if key == "anyOf" or not exact:
        return {key: parts}
    if key == "oneOf":
        return {"oneOf": parts, ALIGNED_KEY: True}
    base, negated = parts
    if base is False:
        return False
    return {**(base if isinstance(base, dict) else {}), "not": negated, ALIGNED_KEY: True}


def _spread_branches(
    c: Compiler, flats: list[Any], pointer: str, exact: bool
) -> dict[int, tuple[str, list[Any]]] | None:
    """For each member that is an ``anyOf`` or a ``oneOf`` (its siblings merged into each branch):
    the keyword and the branches; for each ``not`` member, ``("not", [the rest, the negated])``.
    None when a branch cannot be merged with its siblings."""
    out: dict[int, tuple[str, list[Any]]] = {}
    for i, f in enumerate(flats):
        if not isinstance(f, dict) or any(k in f for k in ("__conditionals", "__more_one_of", ALIGNED_KEY)):
            continue
        if exact and "not" in f and "anyOf" not in f and "oneOf" not in f:
            try:
                negated = c.flatten(f["not"], pointer)
            except (UnsupportedSchemaError, InvalidSchemaError, GrammarLimitError):
                return None
            if isinstance(negated, bool):
                continue  # a form the shapes refuse
            out[i] = ("not", [{k: v for k, v in f.items() if k != "not"}, negated])
            continue
        if ("anyOf" in f) == ("oneOf" in f) or "not" in f:
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
        for k in (
            "anyOf",
            "oneOf",
            "not",
            "__conditionals",
            "__more_one_of",
            "__not_types",
            "__all_of",
            ALIGNED_KEY,
        )
    ):
        return None
    t = flat.get("type")
    names = set(_TYPES) if t is None else (set(t) if isinstance(t, list) else {t})
    if "integer" in names:
        names.add("number")
    listed = _listed(flat)
    if listed is not None:
        names &= {_json_type(v) for v in listed}  # an enum's grammar writes no other type
    return names & set(_TYPES)


def _listed(flat: dict[str, Any]) -> list[Any] | None:
    """The values ``enum``/``const`` list, or None."""
    if "enum" not in flat and "const" not in flat:
        return None
    return [
        *(flat["enum"] if isinstance(flat.get("enum"), list) else []),
        *([flat["const"]] if "const" in flat else []),
    ]


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int | float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


def _listed_containers_judged(flats: list[Any], shapes: list[Any]) -> bool:
    """Whether an item lists an object or an array (``enum``/``const``) where another item takes
    that type: a listed value is read in its own spellings (numbers in any fraction form, members
    of small objects in any order), which are not the ones the others write and read."""
    for i, f in enumerate(flats):
        listed = _listed(f) if isinstance(f, dict) else None
        if listed is None:
            continue
        for kind, name in ((dict, "object"), (list, "array")):
            if any(isinstance(v, kind) for v in listed) and any(
                j != i and name in shape for j, shape in enumerate(shapes)
            ):
                return True
    return False


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
    """Whether ``flat``'s string grammar reads printable ASCII unescaped only (an automaton of a
    pattern, a known format, excluded or listed strings); the free one reads any escape."""
    if not isinstance(flat, dict):
        return False
    fmt = flat.get("format")
    excluded = [*flat.get("__not_values", []), *(_listed(flat) or [])]
    return (
        "pattern" in flat
        or "__not_patterns" in flat
        or (isinstance(fmt, str) and not is_unknown_format(fmt))
        or any(isinstance(v, str) for v in excluded)
    )


def _numeric(flat: Any, numbers: str) -> tuple[Any, ...]:
    """A class of number grammars that write and read the same spellings: integers under
    ``multipleOf`` alone, and plain integers where digits are not limited (``numbers="exact"``):
    digit strings of any length, ``-0`` included (residue automata, the integer grammar);
    otherwise the numeric keywords themselves (equal keywords, one grammar)."""
    if not isinstance(flat, dict):
        flat = {}  # true: the free number grammar, as a schema without numeric keywords
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


def _align_objects(c: Compiler, objs: list[Any], pointer: str, depth: int, exact: bool) -> list[Any] | None:
    if any(isinstance(o, dict) and any(k in o for k in _OBJECT_BLOCKERS) for o in objs):
        return None
    # Declared names and required ones (an object grammar writes required undeclared names right
    # after the declared ones, in `required` order, and so do the branches dependencies lower
    # to): all of them declared, in one order.
    names: list[str] = []
    for o in objs:
        if not isinstance(o, dict):
            continue
        deps = o.get("dependentRequired", {})
        for n in [
            *o.get("properties", {}),
            *o.get("required", []),
            *deps,
            *(d for v in deps.values() for d in v),
        ]:
            if isinstance(n, str) and n not in names:
                names.append(n)
    if any(isinstance(o, dict) and o.get("patternProperties") for o in objs):
        out = _align_patterned(c, objs, names, pointer, depth, exact)
    else:
        out = _align_columns(c, objs, names, pointer, depth, exact)
    if (
        out is not None
        and exact
        and not names
        and any("patternProperties" in o or "propertyNames" in o for o in out)
    ):
        # A key automaton reads printable ASCII unescaped, the free key any escape; with no
        # declared name (whose complement is an automaton too) every item reads keys by one.
        for o in out:
            o.setdefault("propertyNames", {"pattern": ""})
    return out


def _align_columns(
    c: Compiler, objs: list[Any], names: list[str], pointer: str, depth: int, exact: bool
) -> list[Any] | None:
    """Objects without ``patternProperties``: each declared name's schemas aligned as one family,
    and ``additionalProperties``' as another."""
    extra = [o.get("additionalProperties", True) if isinstance(o, dict) else True for o in objs]
    columns: dict[str, list[Any]] = {}
    for n in names:
        col = [
            (o.get("properties", {}).get(n, e) if isinstance(o, dict) else True) for o, e in zip(objs, extra)
        ]
        aligned = align_family(c, col, f"{pointer}/properties/{n}", depth + 1, exact=exact)
        if aligned is None:
            return None
        columns[n] = aligned
    aligned_extra = align_family(c, extra, f"{pointer}/additionalProperties", depth + 1, exact=exact)
    if aligned_extra is None:
        return None
    out = []
    for k, o in enumerate(objs):
        base = dict(o) if isinstance(o, dict) else {}
        if names:
            base["properties"] = {n: columns[n][k] for n in names}
        base[ONE_ORDER_KEY] = True
        if "additionalProperties" in base or aligned_extra[k] is not True:
            base["additionalProperties"] = aligned_extra[k]
        out.append(base)
    return out


def _align_patterned(
    c: Compiler, objs: list[Any], names: list[str], pointer: str, depth: int, exact: bool
) -> list[Any] | None:
    """Objects some of which have ``patternProperties``. A member's value is judged under the
    merge of every schema that applies to its name (the declared one, the matching patterns'),
    and merges of schemas aligned in one family stay aligned (one member order, one spelling):
    so every schema of every item that can apply to a member (each declared name's, each
    pattern's, ``additionalProperties``) is aligned in one family."""
    family: list[Any] = []
    slots: list[tuple[int, str, str]] = []  # (item, "properties" | "patternProperties" | "", key)
    for k, o in enumerate(objs):
        o = o if isinstance(o, dict) else {}
        pats = o.get("patternProperties", {})
        extra = o.get("additionalProperties", True)
        for n in names:
            hits = [v for p, v in pats.items() if c.matches(p, n)]
            own = o.get("properties", {}).get(n, True if hits else extra)
            family.append({"allOf": [own, *hits]} if hits else own)
            slots.append((k, "properties", n))
        for p, v in pats.items():
            family.append(v)
            slots.append((k, "patternProperties", p))
        family.append(extra)
        slots.append((k, "", ""))
    aligned = align_family(c, family, f"{pointer}/patternProperties", depth + 1, exact=exact)
    if aligned is None:
        return None
    out = [dict(o) if isinstance(o, dict) else {} for o in objs]
    for (k, where, key), schema in zip(slots, aligned):
        if where:
            out[k][where] = {**out[k].get(where, {}), key: schema}
        elif "additionalProperties" in out[k] or schema is not True:
            out[k]["additionalProperties"] = schema
    for o in out:
        if names:
            o["properties"] = {n: o["properties"][n] for n in names}  # one order for every item
        o[ONE_ORDER_KEY] = True
    return out


def _align_arrays(c: Compiler, arrs: list[Any], pointer: str, depth: int, exact: bool) -> list[Any] | None:
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
    aligned_cols = [align_family(c, col, f"{pointer}/prefixItems", depth + 1, exact=exact) for col in columns]
    aligned_rest = align_family(c, rest, f"{pointer}/items", depth + 1, exact=exact)
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
