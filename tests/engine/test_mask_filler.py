"""The engine's mask path: MaskFiller (native fill, overlapped or inline, with draft rows) and
GrammarManager.apply_masks (one native call for CPU float32 logits, the backend path otherwise),
including rows that allow every token, which are reported and never masked."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from grammar_support import GRAMMARS, INSTANCES, hf_tokenizer, tokenizer_info

from agent_infer import SamplingParams
from agent_infer.engine.grammar_manager import GrammarManager
from agent_infer.engine.mask_filler import MaskFiller
from agent_infer.errors import MatcherBusyError
from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask, apply_token_bitmask_inplace_torch
from agent_infer.grammar.runtime.matcher import GrammarMatcher
from agent_infer.structured import StructuredOutput


@dataclass
class _Row:
    """What start_masks reads of a sequence: its matcher."""

    matcher: GrammarMatcher | None


def _vocab() -> int:
    return tokenizer_info("smollm2").vocab_size


def _ids() -> list[int]:
    return list(hf_tokenizer("smollm2").encode(INSTANCES["order"][0], add_special_tokens=False).ids)


def _matcher(depth: int) -> GrammarMatcher:
    m = GrammarMatcher(GrammarCompiler(tokenizer_info("smollm2")).compile(GRAMMARS["order"]()))
    for tid in _ids()[:depth]:
        assert m.accept_token(tid)
    return m


def _allows_everything() -> GrammarMatcher:
    info = TokenizerInfo([b"a", b"b", b"ab", b""], eos_token_ids=[3])
    return GrammarMatcher(GrammarCompiler(info).compile(StructuredOutput.regex("[ab]*").to_grammar()))


def _single(m: GrammarMatcher) -> torch.Tensor:
    row = allocate_token_bitmask(1, _vocab())
    m.fill_next_token_bitmask(row, 0)
    return row[0]


@pytest.mark.parametrize("overlap", [True, False])
def test_rows_and_draft_rows_equal_single_fills(overlap: bool) -> None:
    filler = MaskFiller(_vocab(), overlap=overlap)
    try:
        a, b, c = _matcher(3), _matcher(11), _matcher(20)
        draft = tuple(_ids()[20:22])
        pending = filler.start([a, None, b, c], [(), (), (), draft])
        assert pending is not None
        bitmask = pending.result()
        assert bitmask.shape[0] == 6 and pending.rows == [0, 2, 3, 4, 5]
        assert torch.equal(bitmask[0], _single(a)) and torch.equal(bitmask[2], _single(b))
        assert bool((bitmask[1] == -1).all())  # the unconstrained row allows everything
        walker = c.fork()
        for j in range(3):
            assert torch.equal(bitmask[3 + j], _single(walker)), j
            if j < 2:
                assert walker.accept_token(draft[j])
        assert pending.restricting == [0, 2, 3, 4, 5]
        assert pending.fill_seconds > 0.0
        assert torch.equal(_single(c), _single(c.fork()))  # c was rolled back
    finally:
        filler.shutdown()


@pytest.mark.parametrize("overlap", [True, False])
def test_a_reused_bitmask_row_without_a_matcher_allows_everything(overlap: bool) -> None:
    filler = MaskFiller(_vocab(), overlap=overlap)
    try:
        a, b = _matcher(5), _matcher(9)
        first = filler.start([a, b])
        assert first is not None
        assert not bool((first.result()[0] == -1).all())  # row 0 restricted in this step
        second = filler.start([None, b, None, a, *([None] * 6)])  # 10 rows: the bitmask grows
        assert second is not None
        bitmask = second.result()
        assert bitmask.shape[0] == 10
        assert all(bool((bitmask[r] == -1).all()) for r in (0, 2, 4, 5, 6, 7, 8, 9))
        assert torch.equal(bitmask[1], _single(b)) and torch.equal(bitmask[3], _single(a))
        third = filler.start([None, a])  # fewer rows again, reusing the grown bitmask
        assert third is not None
        assert bool((third.result()[0] == -1).all()) and torch.equal(third.result()[1], _single(a))
    finally:
        filler.shutdown()


def test_nothing_constrained_starts_nothing() -> None:
    filler = MaskFiller(_vocab(), overlap=True)
    assert filler.start([None, None]) is None
    assert filler.start([None], [(5, 6)]) is None
    assert filler._thread is None  # no thread for unconstrained steps


def test_matchers_are_busy_until_the_join() -> None:
    # Inline, the fill runs at the join: between start and join the matcher is deterministically
    # the fill's (overlapped, it is the fill thread's until that has run it).
    filler = MaskFiller(_vocab(), overlap=False)
    m = _matcher(4)
    pending = filler.start([m])
    assert pending is not None
    with pytest.raises(MatcherBusyError):
        m.accept_token(_ids()[4])
    pending.result()
    assert m.accept_token(_ids()[4])


def test_after_shutdown_fills_run_on_the_caller() -> None:
    filler = MaskFiller(_vocab(), overlap=True)
    m = _matcher(2)
    first = filler.start([m])
    assert first is not None
    first.result()
    filler.shutdown()
    filler.shutdown()
    pending = filler.start([m])
    assert pending is not None
    assert torch.equal(pending.result()[0], _single(m))


@pytest.mark.parametrize("backend", ["auto", "cpu", "torch"])
def test_apply_masks_skips_rows_that_allow_everything(
    backend: str, monkeypatch: pytest.MonkeyPatch, loaded_model: Any
) -> None:
    monkeypatch.setenv("AGENT_INFER_MASK_BACKEND", backend)
    manager = GrammarManager(loaded_model.tokenizer, _vocab(), frozenset({2}), overlap=True)
    try:
        a, free = _matcher(6), _allows_everything()
        pending = manager.start_masks([_Row(a), _Row(None), _Row(free)])  # type: ignore[list-item]
        logits = torch.randn(3, _vocab())
        before = logits.clone()
        manager.apply_masks(logits, pending)
        assert pending is not None and pending.restricting == [0]
        expected = before.clone()
        apply_token_bitmask_inplace_torch(expected[:1], pending.result()[:1])
        assert torch.equal(logits, expected)
        assert torch.equal(logits[1:], before[1:])  # unconstrained and allow-everything rows untouched
        assert manager.timings().mask_fills == 1
    finally:
        manager.shutdown()


def test_generation_is_the_same_with_every_mask_backend(
    make_llm: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    schema = {"type": "array", "items": {"type": "string"}, "maxItems": 3}
    params = [SamplingParams(temperature=0.0, max_tokens=24, structured=schema) for _ in range(2)]
    prompts = ["List three rivers as a JSON array.", "Name two colours as a JSON array."]
    texts = {}
    for backend in ("auto", "torch"):
        monkeypatch.setenv("AGENT_INFER_MASK_BACKEND", backend)
        llm = make_llm(forced_tokens=False, speculative_tokens=0)
        texts[backend] = [o.text for o in llm.generate(prompts, params)]
    assert texts["auto"] == texts["torch"]
