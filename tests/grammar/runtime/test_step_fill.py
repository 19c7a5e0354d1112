"""The engine step's native fill (StepFill on a FillThread or on its caller): every row equals a
single fill, draft rows equal a walk along the draft, rows that allow everything are reported and
left unmasked, the matchers are busy until the fill has run, and bad arguments are typed errors."""

from __future__ import annotations

import gc

import pytest
import torch
from grammar_support import GRAMMARS, INSTANCES, hf_tokenizer, tokenizer_info

from agent_infer.errors import MatcherBusyError, MatcherUsageError, TokenBitmaskError
from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask, apply_token_bitmask_inplace_torch
from agent_infer.grammar.runtime.matcher import GrammarMatcher
from agent_infer.grammar.runtime.step_fill import FillThread, StepFill
from agent_infer.structured import StructuredOutput


def _vocab() -> int:
    return tokenizer_info("smollm2").vocab_size


def _ids() -> list[int]:
    return list(hf_tokenizer("smollm2").encode(INSTANCES["order"][0], add_special_tokens=False).ids)


def _matchers(n: int) -> list[GrammarMatcher]:
    """``n`` matchers of one grammar at different depths of its instance."""
    compiled = GrammarCompiler(tokenizer_info("smollm2")).compile(GRAMMARS["order"]())
    ids = _ids()
    out = []
    for i in range(n):
        m = GrammarMatcher(compiled)
        for tid in ids[: (i * 7) % (len(ids) - 1)]:
            assert m.accept_token(tid)
        out.append(m)
    return out


def _single(m: GrammarMatcher) -> tuple[torch.Tensor, bool]:
    row = allocate_token_bitmask(1, _vocab())
    restricts = m.fill_next_token_bitmask(row, 0)
    return row[0], restricts


def _any_token() -> GrammarMatcher:
    """A matcher whose every next token is allowed: a small vocabulary of ``a``/``b`` tokens, any
    string of them, EOS once it may end (now)."""
    info = TokenizerInfo([b"a", b"b", b"ab", b""], eos_token_ids=[3])
    return GrammarMatcher(GrammarCompiler(info).compile(StructuredOutput.regex("[ab]*").to_grammar()))


def _rejected(m: GrammarMatcher) -> int:
    """A token ``m`` does not accept next."""
    row, _ = _single(m)
    for i in range(_vocab()):
        if not (int(row[i // 32]) >> (i % 32)) & 1:
            return i
    raise AssertionError("every token is allowed")


@pytest.mark.parametrize("threaded", [False, True])
def test_rows_equal_single_fills(threaded: bool) -> None:
    matchers = _matchers(6)
    rows = [5, 0, 3, 7, 1, 6]  # rows 2 and 4 have no matcher: set to allow everything
    bitmask = torch.zeros((8, allocate_token_bitmask(1, _vocab()).shape[1]), dtype=torch.int32)
    fill = StepFill(matchers, rows, [], bitmask, cached_threads=1)
    thread = FillThread()
    try:
        if threaded:
            assert thread.submit(fill)
        flags = fill.finish()
    finally:
        thread.stop()
    assert fill.done and fill.seconds >= 0.0
    for m, row, flag in zip(matchers, rows, flags):
        expected, restricts = _single(m)
        assert torch.equal(bitmask[row], expected)
        assert flag is restricts
    assert bool((bitmask[2] == -1).all()) and bool((bitmask[4] == -1).all())


def test_draft_rows_equal_a_walk_and_the_matcher_is_rolled_back() -> None:
    (m,) = _matchers(1)
    ids = _ids()
    draft = ids[:3]
    before = _single(m)[0]
    bitmask = allocate_token_bitmask(5, _vocab())
    fill = StepFill([], [], [(m, 1, draft)], bitmask)
    flags = fill.finish()
    assert len(flags) == 4
    walker = m.fork()
    for j in range(4):
        expected, restricts = _single(walker)
        assert torch.equal(bitmask[1 + j], expected), j
        assert flags[j] is restricts
        if j < 3:
            assert walker.accept_token(draft[j])
    assert torch.equal(_single(m)[0], before)  # rolled back to where it was
    assert m.accept_token(draft[0])


def test_a_draft_the_grammar_rejects_is_a_typed_error_and_rolls_back() -> None:
    (m,) = _matchers(1)
    first = _ids()[0]
    before = _single(m)[0]
    bad = (first, _rejected(_walked(m, first)))
    fill = StepFill([], [], [(m, 0, bad)], allocate_token_bitmask(3, _vocab()))
    with pytest.raises(MatcherUsageError, match=f"rejected draft token {bad[1]} \\(position 1\\)"):
        fill.finish()
    assert torch.equal(_single(m)[0], before)  # the accepted prefix was rolled back
    assert m.accept_token(first)


def _walked(m: GrammarMatcher, token: int) -> GrammarMatcher:
    fork = m.fork()
    assert fork.accept_token(token)
    return fork


def test_apply_cpu_masks_restricting_rows_only() -> None:
    matchers = [*_matchers(2), _any_token()]
    bitmask = allocate_token_bitmask(3, _vocab())
    fill = StepFill(matchers, [0, 1, 2], [], bitmask)
    logits = torch.randn(3, _vocab())
    expected = logits.clone()
    fill.apply_cpu(logits)
    assert fill.finish() == [True, True, False]
    apply_token_bitmask_inplace_torch(expected, bitmask, [0, 1])
    assert torch.equal(logits, expected)  # row 2 allows every token: left as it was
    with pytest.raises(TokenBitmaskError, match="3 rows but the logits only 2"):
        fill.apply_cpu(torch.zeros(2, _vocab()))


def test_matchers_are_busy_until_the_fill_has_run() -> None:
    (m,) = _matchers(1)
    fill = StepFill([m], [0], [], allocate_token_bitmask(1, _vocab()))
    with pytest.raises(MatcherBusyError):
        m.accept_token(_ids()[0])
    fill.finish()
    m.fork()  # free again


def test_dropping_a_queued_fill_waits_for_it() -> None:
    matchers = _matchers(4)
    bitmask = allocate_token_bitmask(4, _vocab())
    thread = FillThread()
    try:
        fill = StepFill(matchers, [0, 1, 2, 3], [], bitmask)
        assert thread.submit(fill)
        del fill
        gc.collect()
        # The fill has run (the handle's destructor waited) and released every matcher.
        for m in matchers:
            m.fork()
        assert torch.equal(bitmask[3], _single(matchers[3])[0])
    finally:
        thread.stop()


def test_a_stopped_thread_refuses_and_the_caller_runs_the_fill() -> None:
    thread = FillThread()
    thread.stop()
    thread.stop()
    (m,) = _matchers(1)
    bitmask = allocate_token_bitmask(1, _vocab())
    fill = StepFill([m], [0], [], bitmask)
    assert not thread.submit(fill)
    assert fill.finish() == [_single(m)[1]]
    assert torch.equal(bitmask[0], _single(m)[0])


def test_bad_arguments_are_typed_errors() -> None:
    a, c = _matchers(2)
    vocab = _vocab()
    bitmask = allocate_token_bitmask(3, vocab)
    with pytest.raises(MatcherUsageError, match="appears twice"):
        StepFill([a, a], [0, 1], [], bitmask)
    with pytest.raises(MatcherUsageError, match="appears twice"):
        StepFill([a], [0], [(a, 1, (1,))], bitmask)
    with pytest.raises(TokenBitmaskError, match="same bitmask row"):
        StepFill([a], [1], [(c, 0, (_ids()[0],))], bitmask)
    with pytest.raises(TokenBitmaskError, match="row 3 is outside"):
        StepFill([a], [3], [], bitmask)
    with pytest.raises(TokenBitmaskError, match="row 3 is outside"):
        StepFill([], [], [(a, 2, (1,))], bitmask)
    with pytest.raises(TokenBitmaskError, match="1 matchers but 2 rows"):
        StepFill([a], [0, 1], [], bitmask)
    with pytest.raises(TokenBitmaskError, match="words"):
        StepFill([a], [0], [], torch.full((1, 8), -1, dtype=torch.int32))
    with pytest.raises(TokenBitmaskError, match="int32 CPU tensor torch allocated"):
        StepFill([a], [0], [], bitmask.to(torch.int64))
    with pytest.raises(TokenBitmaskError, match="int32 CPU tensor torch allocated"):
        StepFill([a], [0], [], bitmask.t())
    with pytest.raises(MatcherUsageError, match="not a GrammarMatcher"):
        StepFill(["m"], [0], [], bitmask)  # type: ignore[list-item]
    # A refused fill holds nothing: the matchers are free.
    a.fork()
    c.fork()
