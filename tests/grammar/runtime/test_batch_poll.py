"""Pool threads poll between back-to-back batch fills instead of sleeping, and only then.

A sleeping thread's wake-up costs tens to hundreds of µs on a virtual machine, as much as a
whole batch of cached rows, so in a tight loop of fills the helper arrives after the caller has
filled most rows. The pool threads therefore poll for the next batch while fills come less than
``AGENT_INFER_GRAMMAR_SPIN_US`` apart; the native ``polled_joins`` counter tells joins found by
polling from joins after a wake-up. Every batch is compared with one-at-a-time fills. In the
polling tests each batch waits for the pool thread to join it (``grammar_batch_wait_for_helper``),
so every batch has a join to classify whatever the machine's load.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest
import torch
from grammar_support import GRAMMARS, INSTANCES, hf_tokenizer, tokenizer_info

from agent_infer.errors import ConfigError
from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask
from agent_infer.grammar.runtime.matcher import GrammarMatcher, fill_next_token_bitmask_batch
from agent_infer.native import load_native

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="the pool has no helper thread on one core")


def _matchers() -> list[GrammarMatcher]:
    """24 matchers of one grammar at different depths of its instance."""
    info = tokenizer_info("smollm2")
    compiled = GrammarCompiler(info).compile(GRAMMARS["order"]())
    ids = hf_tokenizer("smollm2").encode(INSTANCES["order"][0], add_special_tokens=False).ids
    matchers = []
    for i in range(24):
        m = GrammarMatcher(compiled)
        for tid in ids[: (i * 5) % (len(ids) - 1)]:
            assert m.accept_token(tid)
        matchers.append(m)
    return matchers


@pytest.fixture
def helper_joins_every_batch() -> Iterator[None]:
    # Each batch waits until the pool thread has joined it before the caller claims a row. Without
    # this, whether the pool thread gets a core before the caller has filled every row is up to
    # the machine's load, and a loaded machine can keep it off every batch of a loop; what these
    # tests check is how it joins (by polling or after a wake-up) and which rows it takes.
    native = load_native()
    native.grammar_batch_wait_for_helper(True)
    try:
        yield
    finally:
        native.grammar_batch_wait_for_helper(False)


def _fill_back_to_back(matchers: list[GrammarMatcher], rounds: int) -> tuple[int, int]:
    """Batch fills in a tight loop, each checked against single fills; returns (polled joins, joins)."""
    single = allocate_token_bitmask(len(matchers), tokenizer_info("smollm2").vocab_size)
    batch = torch.empty_like(single)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(single, i)
    native = load_native()
    fill_next_token_bitmask_batch(matchers, batch, num_threads=2)  # applies the env setting
    time.sleep(0.01)  # a poll begun under an earlier setting has ended
    before = native.grammar_batch_stats()
    for _ in range(rounds):
        batch.fill_(0x5A5A5A5A)
        fill_next_token_bitmask_batch(matchers, batch, num_threads=2)
        assert torch.equal(batch, single)
    after = native.grammar_batch_stats()
    return (
        int(after["polled_joins"] - before["polled_joins"]),
        int(after["helper_joins"] - before["helper_joins"]),
    )


@pytest.mark.usefixtures("helper_joins_every_batch")
def test_back_to_back_fills_are_joined_by_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENT_INFER_GRAMMAR_SPIN_US", raising=False)
    matchers = _matchers()
    # A loaded machine can stretch every gap of one loop past the budget: a few loops, not one.
    counts = [_fill_back_to_back(matchers, 60) for _ in range(3)]
    assert all(joins == 60 for _, joins in counts), counts  # the pool thread took part in every batch
    assert max(polled for polled, _ in counts) > 0, f"no batch was joined by a polling thread ({counts})"


@pytest.mark.usefixtures("helper_joins_every_batch")
def test_spin_zero_never_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_INFER_GRAMMAR_SPIN_US", "0")
    matchers = _matchers()
    assert _fill_back_to_back(matchers, 60) == (0, 60)


def test_bad_spin_setting_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    matchers = _matchers()
    bitmask = allocate_token_bitmask(len(matchers), tokenizer_info("smollm2").vocab_size)
    monkeypatch.setenv("AGENT_INFER_GRAMMAR_SPIN_US", "-3")
    with pytest.raises(ConfigError, match="AGENT_INFER_GRAMMAR_SPIN_US"):
        fill_next_token_bitmask_batch(matchers, bitmask)


def test_cached_rows_keep_their_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    # The caller claims rows from the front and pool threads from the back: a row's bitmask
    # lines stay in the cache of the core that wrote them the step before.
    monkeypatch.delenv("AGENT_INFER_GRAMMAR_SPIN_US", raising=False)
    matchers = _matchers()
    _fill_back_to_back(matchers, 5)  # every state's mask is cached: no row is claimed first
    native = load_native()
    shared = 0
    for _ in range(3):
        native.grammar_batch_trace(True)
        _fill_back_to_back(matchers, 40)
        events = native.grammar_batch_trace(False)
        batches = [e for e in events if e[0] == "b" and e[1] == len(matchers)]
        rows = [e for e in events if e[0] == "r"]
        for b in batches:
            mine = [e[1] for e in rows if b[3] <= e[3] <= b[4] and e[2] == b[2]]
            theirs = [e[1] for e in rows if b[3] <= e[3] <= b[4] and e[2] != b[2]]
            if mine and theirs:
                shared += 1
                assert max(mine) < min(theirs), (sorted(mine), sorted(theirs))
    if shared == 0:
        # A loaded machine can keep the pool thread off every fill: nothing to check then.
        pytest.skip("no batch was shared with a pool thread")
