"""Batch fills split first-visit walks across threads; the masks equal sequential fills bit for bit.

Each comparison runs the same matchers twice from cold tokenizer caches (a fresh
``TokenizerInfo`` per run): once one matcher at a time on this thread, once in batch fills on the
thread pool, where large first-visit walks are cut into parts that several threads run. Both
the filled rows and every scanning item's cached classification (accepted and uncertain counts)
must match at every step, and the native counter must show that walks were actually split.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from grammar_support import hf_tokenizer, tokenizer_info

from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.ir import Grammar
from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask
from agent_infer.grammar.runtime.matcher import GrammarMatcher, fill_next_token_bitmask_batch
from agent_infer.native import load_native

# Dense first visits of several kinds: free keys (pieces), maxLength strings (counted repeats),
# enums, patterns, numbers with bounds, nested objects and arrays (pushdown walks).
SCHEMAS: list[tuple[dict[str, Any], Any]] = [
    (
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "kind": {"enum": ["cat", "dog", "bird"]},
                "age": {"type": "integer", "minimum": 0},
            },
            "required": ["name", "kind", "age"],
        },
        {"name": "Luna the second of her name", "kind": "cat", "age": 7},
    ),
    (
        {"type": "array", "items": {"type": "object", "additionalProperties": {"type": "number"}}},
        [{"x": 1.5, "why not": -2}, {"ünïcode": 3e5}],
    ),
    (
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^[a-z]{2,8}-[0-9]+$"},
                "tags": {"type": "array", "items": {"type": "string", "minLength": 2}, "maxItems": 4},
                "meta": {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "null"}}},
            },
        },
        {"id": "abc-42", "tags": ["red", "green  blue"], "meta": {"ok": True, "n": None}},
    ),
    (
        {"type": "object", "properties": {"text": {"type": "string", "minLength": 3, "maxLength": 300}}},
        {"text": 'Quoted "words", tabs\tand a long enough sentence to cross many positions.'},
    ),
    ({}, {"any": [1, "two", {"three": None}], "x": "y"}),
    # A loop region no tokenizer precomputes (the shared region walk itself splits).
    (
        {"type": "object", "properties": {"email": {"type": "string", "pattern": "^[^@]+@[a-z]+\\.com$"}}},
        {"email": "ada.lovelace+x@example.com"},
    ),
    # Search patterns: loop regions whose states send most first bytes back to "nothing matched
    # yet" (region pieces, depth-1 region walks, per-target digests built by the threads together).
    (
        {
            "type": "object",
            "properties": {
                "repo": {"type": "string", "pattern": "github\\.com/[a-z]+/[a-z]+"},
                "site": {"type": "string", "pattern": "https?://[a-z]+\\.(org|com)/"},
            },
        },
        {"repo": "see https://github.com/agent/infer for the code", "site": "at http://example.org/x"},
    ),
    # Alternatives anchored at opposite ends (`allow` then anything, or anything then `deny`) and
    # a chain of word classes: a state's first bytes lead into several loop regions, whose
    # depth-1 walks the batch's threads take one each.
    (
        {
            "type": "object",
            "properties": {
                "effect": {"type": "string", "pattern": "^allow|deny$"},
                "resource": {"type": "string", "pattern": "^brn:(\\w+):(\\w*):(\\*|[\\w\\-]*\\*?)$"},
            },
        },
        {"effect": "allowed, then denied later: deny", "resource": "brn:aws:uswest2:queue-42*"},
    ),
]


def _fresh(info: TokenizerInfo) -> TokenizerInfo:
    """A copy of ``info`` with empty mask caches: every state is a first visit again."""
    return TokenizerInfo(info.decoded_vocab, vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids)


def _matchers(info: TokenizerInfo, tok_name: str) -> tuple[list[GrammarMatcher], list[list[int]]]:
    """Matchers at several depths of each instance, and the tokens each one reads next."""
    compiler = GrammarCompiler(info, cache_enabled=False)
    tok = hf_tokenizer(tok_name)
    matchers, rest = [], []
    for schema, doc in SCHEMAS:
        compiled = compiler.compile(Grammar.from_json_schema(schema, whitespace="compact"))
        ids = tok.encode(
            json.dumps(doc, separators=(",", ":"), ensure_ascii=False), add_special_tokens=False
        ).ids
        for cut in sorted({0, 1, len(ids) // 3, len(ids) // 2, len(ids) - 3}):
            m = GrammarMatcher(compiled)
            for t in ids[:cut]:
                assert m.accept_token(t)
            matchers.append(m)
            rest.append(ids[cut:])
    return matchers, rest


def _items(m: GrammarMatcher) -> list[tuple[int, ...]]:
    """(state, rule, origin, accepted, uncertain) of each scanning item, as the native cache has them."""
    return [tuple(int(x) for x in it) for it in m._m.debug_items()]


@pytest.fixture(params=["auto", "tiny"])
def split_parts(request: pytest.FixtureRequest) -> Iterator[str]:
    """Default split sizes, or parts of 97 tokens and every walk split: seams land everywhere,
    inside runs of dead, uncertain and accepted tokens alike."""
    native = load_native()
    old = native.grammar_split_tuning(1, 97) if request.param == "tiny" else None
    yield request.param
    if old is not None:
        native.grammar_split_tuning(*old)


@pytest.mark.parametrize("tok_name", ["deepseek", "smollm2"])
@pytest.mark.parametrize("threads", [2, 4])
def test_batch_split_equals_sequential_cold(tok_name: str, threads: int, split_parts: str) -> None:
    base = tokenizer_info(tok_name)
    seq_m, rest = _matchers(_fresh(base), tok_name)
    bat_m, _ = _matchers(_fresh(base), tok_name)
    n, vocab = len(seq_m), base.vocab_size
    seq_mask = allocate_token_bitmask(n, vocab)
    bat_mask = allocate_token_bitmask(n, vocab)
    native = load_native()
    stats_before = native.grammar_batch_stats()
    for step in range(6):
        live = [i for i in range(n) if step < len(rest[i])]
        for i in live:
            seq_m[i].fill_next_token_bitmask(seq_mask, i)
        bat_mask.fill_(0x5A5A5A5A)  # stale contents must be overwritten
        fill_next_token_bitmask_batch([bat_m[i] for i in live], bat_mask, live, num_threads=threads)
        for i in live:
            a, b = seq_mask[i].numpy(), bat_mask[i].numpy()
            assert np.array_equal(a, b), (step, i, np.nonzero(a != b)[0][:5])
            assert _items(seq_m[i]) == _items(bat_m[i]), (step, i)
            assert seq_m[i].accept_token(rest[i][step]) and bat_m[i].accept_token(rest[i][step])
    stats = native.grammar_batch_stats()
    assert stats["split_walks"] > stats_before["split_walks"], "no walk was split: the test exercised nothing"
    assert stats["parallel_loops"] > stats_before["parallel_loops"], "no first-visit loop was shared"


def test_single_row_batch_splits_with_idle_pool() -> None:
    """A batch of one row still splits its walks: idle pool threads help."""
    base = tokenizer_info("deepseek")
    # A string over a narrow alphabet: its positions walk the vocabulary (a free-text string's
    # take the content tokens whole instead, grammar/mask/content.cpp).
    schema = {"type": "object", "additionalProperties": {"type": "string", "pattern": "^[a-z ]{0,30}$"}}
    grammar = Grammar.from_json_schema(schema, whitespace="compact")
    ref = GrammarMatcher(GrammarCompiler(_fresh(base), cache_enabled=False).compile(grammar))
    m = GrammarMatcher(GrammarCompiler(_fresh(base), cache_enabled=False).compile(grammar))
    ids = hf_tokenizer("deepseek").encode('{"key one":"value","k2":"', add_special_tokens=False).ids
    native = load_native()
    before = native.grammar_batch_stats()["split_walks"]
    a = allocate_token_bitmask(1, base.vocab_size)
    b = allocate_token_bitmask(1, base.vocab_size)
    for t in ids:
        ref.fill_next_token_bitmask(a)
        fill_next_token_bitmask_batch([m], b, num_threads=2)
        assert np.array_equal(a.numpy(), b.numpy())
        assert _items(ref) == _items(m)
        assert ref.accept_token(t) and m.accept_token(t)
    assert native.grammar_batch_stats()["split_walks"] > before


def test_single_fill_does_not_split() -> None:
    """Outside batch fills walks stay on the calling thread (no pool wake-ups per single fill)."""
    base = tokenizer_info("smollm2")
    compiled = GrammarCompiler(_fresh(base), cache_enabled=False).compile(
        Grammar.from_json_schema({"type": "object", "additionalProperties": {"type": "integer"}})
    )
    native = load_native()
    before = native.grammar_batch_stats()["split_walks"]
    GrammarMatcher(compiled).fill_next_token_bitmask(allocate_token_bitmask(1, base.vocab_size))
    assert native.grammar_batch_stats()["split_walks"] == before


@pytest.mark.parametrize("tok_name", ["deepseek", "smollm2"])
def test_parts_reassemble_to_the_whole_walk(tok_name: str) -> None:
    """Every walk kind, cut into parts of a few tokens, reassembles to exactly the whole walk's
    classification (accepted, uncertain, region exits) for each state met along the instances."""
    info = tokenizer_info(tok_name)
    matchers, rest = _matchers(info, tok_name)
    states: dict[tuple[int, int], Any] = {}  # (grammar, state) -> native compiled grammar
    for m, ids in zip(matchers, rest):
        native = m._compiled._native
        for t in [*ids[:2], None]:
            states.update({(id(native), it[0]): native for it in _items(m)})
            if t is not None:
                assert m.accept_token(t)
    # Every part costs a vocabulary-sized bitset: tiny parts only for an even sample of the states.
    keys = sorted(states)
    for key in keys:
        assert states[key].split_matches_whole(key[1], 509), key[1]
    for key in keys[:: max(1, len(keys) // 24)]:
        assert states[key].split_matches_whole(key[1], 37), key[1]
    assert len(keys) >= 24


def test_batch_trace_records_rows_parts_and_the_batch() -> None:
    """The opt-in timeline: one event per row and one per batch, inside the batch's span; parts of
    split walks when a first visit splits; nothing once recording is off."""
    base = tokenizer_info("deepseek")
    matchers, _ = _matchers(_fresh(base), "deepseek")
    native = load_native()
    mask = allocate_token_bitmask(len(matchers), base.vocab_size)
    native.grammar_batch_trace(True)
    fill_next_token_bitmask_batch(matchers, mask, num_threads=2)
    events = native.grammar_batch_trace(False)
    rows = [e for e in events if e[0] == "r"]
    (batch,) = [e for e in events if e[0] == "b"]
    assert sorted(e[1] for e in rows) == list(range(len(matchers)))
    assert batch[1] == len(matchers)
    assert any(e[0] == "p" for e in events), "cold first visits of this batch split"
    for kind, _, _, t0, t1 in events:
        assert t0 <= t1 and batch[3] <= t0 and t1 <= batch[4], kind
    fill_next_token_bitmask_batch(matchers, mask, num_threads=2)
    assert native.grammar_batch_trace() == []


def test_a_row_spreads_its_first_visits_over_the_batch_threads() -> None:
    """A set holding several states met for the first time (a value that may be any of many
    patterns) has their masks computed on the batch's threads; the row equals a single fill."""
    base = tokenizer_info("deepseek")
    patterns = ["^[a-f]+$", "^[0-9]{3}$", "^x[A-Z]*$", "^(ab)+$", "^[ -/]+$", "^[g-m][0-9]$"]
    schema = {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "string", "pattern": p} for p in patterns]}},
    }
    grammar = Grammar.from_json_schema(schema, whitespace="compact")
    ids = hf_tokenizer("deepseek").encode('{"v":"', add_special_tokens=False).ids
    ref = GrammarMatcher(GrammarCompiler(_fresh(base), cache_enabled=False).compile(grammar))
    m = GrammarMatcher(GrammarCompiler(_fresh(base), cache_enabled=False).compile(grammar))
    for t in ids:
        assert ref.accept_token(t) and m.accept_token(t)
    native = load_native()
    before = native.grammar_batch_stats()["spread_rows"]
    a = allocate_token_bitmask(1, base.vocab_size)
    b = allocate_token_bitmask(1, base.vocab_size)
    ref.fill_next_token_bitmask(a)
    fill_next_token_bitmask_batch([m], b, num_threads=2)
    assert np.array_equal(a.numpy(), b.numpy())
    assert _items(ref) == _items(m)
    assert native.grammar_batch_stats()["spread_rows"] == before + 1
    # A single fill keeps its first visits on the calling thread.
    c = GrammarMatcher(GrammarCompiler(_fresh(base), cache_enabled=False).compile(grammar))
    for t in ids:
        assert c.accept_token(t)
    c.fill_next_token_bitmask(allocate_token_bitmask(1, base.vocab_size))
    assert native.grammar_batch_stats()["spread_rows"] == before + 1
