"""Native lowering keeps its work buffers per thread (``grammar/lower/scratch.cpp``); results must not
depend on what the thread lowered before.

Each grammar is lowered once on a fresh thread (fresh buffers: the reference) and again on this
thread after the others, after itself, and after lowerings that ran out of their state budget
partway (one of them in the middle of a determinizer sweep, which leaves per-state counts behind). The automata must come out the same: same
state count and size, and the same byte masks along sample strings.
"""

from __future__ import annotations

import threading

import pytest

from agent_infer.errors import AgentInferError
from agent_infer.grammar.compile.compiler import CompiledGrammar, GrammarCompiler
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.ir import Grammar, Ref, alt, chars, lit, plus, seq
from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask
from agent_infer.grammar.runtime.matcher import GrammarMatcher

INFO = TokenizerInfo.bytes_only()

# (grammar, strings whose masks are compared at every byte)
CASES: list[tuple[Grammar, list[str]]] = [
    (
        Grammar.from_json_schema(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "minLength": 2, "maxLength": 6},
                    "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]+$"},
                    "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "minItems": 1},
                },
                "required": ["name", "code"],
            },
            whitespace="compact",
        ),
        ['{"name":"x\\u00e9y","code":"AB-12","tags":["bb"]}', '{"name":"ab","code":"ZZ-1"}'],
    ),
    (
        Grammar.from_json_schema(
            {"type": "array", "items": {"type": "string", "format": "date"}, "maxItems": 3},
            whitespace="compact",
        ),
        ['["2024-02-29","1999-12-31"]'],
    ),
    (
        Grammar.from_json_schema({"type": "string", "pattern": "^(ab|a[b-y]+z|[a-c]{1,3}q)*$"}),
        ['"abaxyzacq"'],
    ),
]


def _overlapping_ranges() -> Grammar:
    """Many overlapping byte ranges after one state: its DFA successors come from a sweep.

    The separator is a reference so the repeated item is not hoisted into a rule of its own
    (``grammar/lower/hoist.cpp``), whose minimal automaton would be built without a sweep."""
    classes = [chars(f"{chr(ord('a') + i)}-{chr(ord('j') + i)}") for i in range(12)]
    return Grammar.from_rules(
        {"root": plus(seq(alt(*classes), alt(*classes), Ref("semi"))), "semi": lit(";")}
    )


def _lower(grammar: Grammar, max_states: int = 500_000) -> CompiledGrammar:
    return GrammarCompiler(INFO, cache_enabled=False, max_states=max_states).compile(grammar)


def _fingerprint(compiled: CompiledGrammar, texts: list[str]) -> tuple[object, ...]:
    """State count, size, and the byte mask before every character of ``texts`` (ASCII)."""
    masks: list[object] = []
    bitmask = allocate_token_bitmask(1, INFO.vocab_size)
    for text in texts:
        m = GrammarMatcher(compiled)
        for ch in text:
            m.fill_next_token_bitmask(bitmask)
            masks.append(tuple(bitmask[0].tolist()))
            assert m.accept_string(ch), (text, ch)
        masks.append(m.can_terminate())
    return compiled.num_states, compiled.memory_size_bytes, tuple(masks)


def _on_fresh_thread(grammar: Grammar, texts: list[str]) -> tuple[object, ...]:
    out: list[tuple[object, ...]] = []
    thread = threading.Thread(target=lambda: out.append(_fingerprint(_lower(grammar), texts)))
    thread.start()
    thread.join()
    assert out, "lowering on the fresh thread failed"
    return out[0]


def _fail_mid_lowering() -> None:
    """Lowerings that run out of states partway: inside a sweep, and between a schema's rules."""
    with pytest.raises(AgentInferError):
        _lower(_overlapping_ranges(), max_states=3)
    with pytest.raises(AgentInferError):
        _lower(CASES[0][0], max_states=40)


def test_reused_buffers_give_the_fresh_automata() -> None:
    reference = [_on_fresh_thread(g, texts) for g, texts in CASES]
    sweep_reference = _on_fresh_thread(_overlapping_ranges(), ["ab;jk;"])
    for _ in range(2):
        for (grammar, texts), expected in reversed(list(zip(CASES, reference))):
            _fail_mid_lowering()
            assert _fingerprint(_lower(grammar), texts) == expected
            assert _fingerprint(_lower(grammar), texts) == expected
        assert _fingerprint(_lower(_overlapping_ranges()), ["ab;jk;"]) == sweep_reference


def test_sweep_cut_short_leaves_no_trace() -> None:
    expected = _on_fresh_thread(_overlapping_ranges(), ["ab;jk;kt;"])
    others = [_on_fresh_thread(g, texts) for g, texts in CASES]
    for limit in (2, 3, 5, 8):
        for (grammar, texts), other in zip(CASES, others):
            with pytest.raises(AgentInferError):
                _lower(_overlapping_ranges(), max_states=limit)
            assert _fingerprint(_lower(grammar), texts) == other
        assert _fingerprint(_lower(_overlapping_ranges()), ["ab;jk;kt;"]) == expected
