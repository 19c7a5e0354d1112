"""A code-point DFA written as grammar rules over JSON text: right-linear rules whose edges are the
JSON encodings (:func:`encode_class`) of their code-point ranges."""

from __future__ import annotations

from agent_infer.grammar.automata import DFA, live_states
from agent_infer.grammar.common.memo import register_cache
from agent_infer.grammar.frontends.json_schema.types.string_encoding import encode_class
from agent_infer.grammar.ir import Alt, CharClass, Empty, Expr, Ref, Seq

# Class ranges -> the items its JSON encoding contributes to ``seq(encoding, next)``; key
# automata of different objects repeat the same edge classes. Bounded like encode_class's cache.
_HEADS: dict[tuple[tuple[int, int], ...], tuple[Expr, ...]] = {}


_MAX_HEADS = 8192


def encoded_head(ranges: tuple[tuple[int, int], ...]) -> tuple[Expr, ...]:
    """``encode_class(CharClass(ranges))`` as sequence items (cached by ranges)."""
    head = _HEADS.get(ranges)
    if head is None:
        enc = encode_class(CharClass(ranges))
        head = enc.items if isinstance(enc, Seq) else () if isinstance(enc, Empty) else (enc,)
        if len(_HEADS) >= _MAX_HEADS:
            _HEADS.clear()
        _HEADS[ranges] = head
    return head


def dfa_to_rules(a: DFA, prefix: str) -> tuple[Expr, list[tuple[str, Expr]]]:
    """JSON-encoded right-linear rules ``{prefix}{state}``; returns the start expression and rules."""
    live = live_states(a)
    if 0 not in live:
        return Alt(()), []
    rules: list[tuple[str, Expr]] = []
    refs: dict[int, Ref] = {}
    empty = Empty()
    for s in sorted(live):
        by_target: dict[int, list[tuple[int, int]]] = {}
        for lo, hi, t in a.edges[s]:
            if t in live:
                by_target.setdefault(t, []).append((lo, hi))
        # Built directly as seq(encode_class(...), Ref) and alt(...) would: the branches end in
        # distinct references and none is an Alt, so alt() would neither flatten nor drop any.
        branches: list[Expr] = []
        for t, rs in by_target.items():
            ref = refs.get(t)
            if ref is None:
                ref = refs[t] = Ref(f"{prefix}{t}")
            head = encoded_head(tuple(rs))
            branches.append(Seq((*head, ref)) if head else ref)
        if s in a.accept:
            branches.append(empty)
        body = branches[0] if len(branches) == 1 else Alt(tuple(branches))
        rules.append((f"{prefix}{s}", body))
    return Ref(f"{prefix}0"), rules


register_cache(_HEADS)
