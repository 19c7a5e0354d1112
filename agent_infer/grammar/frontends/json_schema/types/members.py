"""An object's member list for the JSON Schema compiler: the declared members in order (each
optional one skippable), then any number of additional members, with the commas between them.

``member_list`` writes it as two chains of tails, "members from here on" after something was
emitted (each needs a comma first) and before anything was (the first one does not); the second
chain only reaches up to the first required member. ``required_first`` gives the second order an
object takes its members in. ``counted_members`` is the list under ``minProperties``/
``maxProperties``: rules per (position, count).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from agent_infer.grammar.ir import Alt, Empty, Expr, Literal, Ref, Seq, alt, lit, opt, seq, star

if TYPE_CHECKING:
    from agent_infer.grammar.frontends.json_schema.compiler import Compiler

MAX_COUNT_STATES = 4000


def _never() -> Expr:
    return Alt(())


def member_list(
    c: Compiler, members: list[tuple[Expr, bool]], extra: Expr | None, depth: int
) -> tuple[Expr | None, bool]:
    """Non-empty member lists (declared order, then extras) and whether ``{}`` is allowed."""
    sep = c.sep(depth)
    # t0 / t1: members from position i on, once something was emitted (each needs a comma first)
    # and before anything was. A Kubernetes schema has ~500 members in ~100 objects, so the
    # helpers of the optional members' loop (seq_items, cat, _big, _or, the node classes'
    # __init__) are written out inline there, where their calls would dominate: same nodes,
    # same rules, in the same order.
    t0: Expr = star(seq(sep, extra)) if extra is not None else Empty()
    t1: Expr = seq(extra, star(seq(sep, extra))) if extra is not None else Alt(())
    nullable = True
    # "Nothing emitted yet" (t1) is only reachable up to the first required member: after it,
    # every later position needs a comma. Past that point t1 is neither built nor made a rule
    # (it would be unreachable, yet written, serialized and lowered).
    first_required = len(members)
    for i, (_, is_required) in enumerate(members):
        if is_required:
            first_required = i
            break
    sep_items = seq_items(sep)
    tail_rule = c.tail_rule
    new, put = _new, _put
    for i in range(len(members) - 1, -1, -1):
        expr, is_required = members[i]
        kind = type(expr)
        expr_items = expr.items if kind is Seq else (() if kind is Empty else (expr,))  # type: ignore[attr-defined]
        if is_required:
            nullable = False
            after = seq_items(t0)
            t0, t1 = (
                cat((*sep_items, *expr_items, *after)),
                cat((*expr_items, *after)) if i <= first_required else _UNREACHED,
            )
            continue
        # _big(t0): a tail that is not a single node is written once, as a rule (tail_rule).
        if not isinstance(t0, _SMALL_KINDS) or (isinstance(t0, Alt) and len(t0.items) > 1):
            ref = new(Ref)
            put(ref, "name", tail_rule(t0))
            t0 = ref
        kind = type(t0)
        after = t0.items if kind is Seq else (() if kind is Empty else (t0,))  # type: ignore[union-attr]
        items = (*sep_items, *expr_items, *after)
        head: Expr
        if len(items) > 1:  # cat(items)
            head = new(Seq)
            put(head, "items", items)
        else:
            head = cat(items)
        # _or(head, t0)
        new0: Expr
        if type(t0) is Alt:
            new0 = _or(head, t0)
        else:
            new0 = new(Alt)
            put(new0, "items", (head, t0))
        if i > first_required:
            t0, t1 = new0, _UNREACHED
            continue
        if not isinstance(t1, _SMALL_KINDS) or (isinstance(t1, Alt) and len(t1.items) > 1):
            ref = new(Ref)
            put(ref, "name", tail_rule(t1))
            t1 = ref
        head = cat((*expr_items, *after))
        if type(t1) is Alt:
            t1 = _or(head, t1)
        else:
            alt1 = new(Alt)
            put(alt1, "items", (head, t1))
            t1 = alt1
        t0 = new0
    if isinstance(t1, Alt) and not t1.items:
        return None, True
    return t1, nullable


def required_first(names: list[str], required: list[str]) -> list[int] | None:
    """The indices of ``names`` with the required ones first, in the order ``required`` lists them,
    then the others in their own order; None when that is the order they have already."""
    rank = {name: i for i, name in enumerate(dict.fromkeys(required))}
    order = sorted(range(len(names)), key=lambda i: (0, rank[names[i]]) if names[i] in rank else (1, i))
    return None if order == list(range(len(names))) else order


# Node construction without the Python frame of the class's __init__ (which does just this).
_new = object.__new__
_put = object.__setattr__


# tail[1] past the first required member (never read).
_UNREACHED: Expr = Alt(())
_EMPTY_ITEMS: tuple[Expr, ...] = ()


def seq_items(e: Expr) -> tuple[Expr, ...]:
    """What ``e`` contributes to a ``seq(...)`` it is an argument of (seq flattens one level)."""
    kind = type(e)
    if kind is Seq:
        return e.items  # type: ignore[attr-defined]
    return _EMPTY_ITEMS if kind is Empty else (e,)


def cat(items: tuple[Expr, ...]) -> Expr:
    """``seq(*items)`` for items that are already flat (from :func:`_seq_items`)."""
    if len(items) > 1:
        return Seq(items)
    return items[0] if items else Empty()


def _or(first: Expr, rest: Expr) -> Expr:
    """``alt(first, rest)`` where ``first`` is a member sequence holding ``rest`` (so the two are
    never equal) and ``rest`` is a tail: an Alt contributes its branches, as alt flattens it."""
    if type(rest) is Alt:
        branches = rest.items
        if not branches:
            return first
        return Alt((first, *branches)) if all(b != first for b in branches) else alt(first, rest)
    return Alt((first, rest))


# A tuple, not ``Empty | Ref | ...``: the union object would be built again on every call.
_SMALL_KINDS = (Empty, Ref, Literal, Alt)


def _big(e: Expr) -> bool:
    return not isinstance(e, _SMALL_KINDS) or (isinstance(e, Alt) and len(e.items) > 1)


def counted_members(
    c: Compiler,
    members: list[tuple[Expr, bool]],
    extra: Expr | None,
    lo: int,
    hi: int | None,
    depth: int,
    pointer: str,
) -> Expr:
    """Members with the number of properties kept in [lo, hi] (states: position x count)."""
    if hi is not None and hi < lo:
        return _never()
    cap = hi if hi is not None else max(lo, 1)
    if (len(members) + 1) * (cap + 1) > MAX_COUNT_STATES:
        keyword = "maxProperties" if hi is not None else "minProperties"
        c.unsupported(
            keyword,
            f"{pointer}/{keyword}",
            f"property count too large: (members + 1) x (count + 1) above {MAX_COUNT_STATES} counting states",
        )
        body, nullable = member_list(c, members, extra, depth)  # non-strict: drop the count, keep the rest
        return c.container("{", "}", body, nullable, depth) if body is not None else c.empty("{", "}")
    sep = c.sep(depth)
    memo: dict[tuple[int, int], Expr] = {}

    def state(i: int, k: int) -> Expr:
        if (i, k) in memo:
            return memo[(i, k)]
        comma = sep if k else Empty()
        if i == len(members):
            need = max(0, lo - k)
            room = None if hi is None else hi - k
            if extra is None or room == 0:
                out: Expr = Empty() if need == 0 else _never()
            elif k:
                out = c.repeat(seq(sep, extra), need, room)
            else:
                rest = c.repeat(seq(sep, extra), max(need - 1, 0), None if room is None else room - 1)
                out = seq(extra, rest) if need else opt(seq(extra, rest))
        else:
            expr, is_required = members[i]
            take = _never() if hi is not None and k >= hi else seq(comma, expr, state(i + 1, min(k + 1, cap)))
            out = take if is_required else alt(take, state(i + 1, k))
        name = c.add_rule(f"{pointer}-n{i}-{k}", out)
        memo[(i, k)] = Ref(name)
        return memo[(i, k)]

    body = state(0, 0)
    full = seq(lit("{"), c.open(depth), body, c.close(depth), lit("}"))
    # The empty object is written "{}" (or with blank inside): it has no members, so it is valid
    # only when no count is required and no member is either.
    if lo == 0 and not any(is_required for _, is_required in members):
        return alt(full, c.empty("{", "}"))
    return full


def members_with_hit(
    c: Compiler,
    members: list[tuple[Expr, bool]],
    member_hit: Callable[[int, int], Expr | None],
    extra: Expr | None,
    extra_hit: Callable[[int], Expr | None],
    needs: int,
    depth: int,
    pointer: str,
) -> Expr:
    """The member list where each of ``needs`` conditions is met by some member: declared member
    i meets the set of needs S (a bit mask) in the form ``member_hit(i, S)``, an additional member
    in the form ``extra_hit(S)`` (None: it cannot). Rules per (position, something emitted, needs
    met): at most 2^(needs + 1) per position."""
    sep = c.sep(depth)
    full = (1 << needs) - 1
    memo: dict[tuple[int, bool, int], Expr] = {}

    def subsets(met: int) -> list[int]:
        free = full & ~met
        return [s for s in range(1, full + 1) if s & free == s]

    def state(i: int, emitted: bool, met: int) -> Expr:
        key = (i, emitted, met)
        if key in memo:
            return memo[key]
        # Reserved before the body is built: the tail state refers to itself (more extras).
        ref = memo[key] = Ref(c.fresh(f"{pointer}-h{i}-{int(emitted)}-{met}"))
        comma = sep if emitted else Empty()
        options: list[Expr] = []
        if i == len(members):
            if met == full:
                options.append(Empty())
            if extra is not None:
                options.append(seq(comma, extra, state(i, True, met)))
            for s in subsets(met):
                hit = extra_hit(s)
                if hit is not None:
                    options.append(seq(comma, hit, state(i, True, met | s)))
        else:
            expr, is_required = members[i]
            options.append(seq(comma, expr, state(i + 1, True, met)))
            for s in subsets(met):
                hit = member_hit(i, s)
                if hit is not None:
                    options.append(seq(comma, hit, state(i + 1, True, met | s)))
            if not is_required:
                options.append(state(i + 1, emitted, met))
        c.rules[ref.name] = alt(*options) if options else _never()
        return ref

    return state(0, False, 0)
