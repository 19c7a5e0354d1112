"""Single fills write the same row into every kind of bitmask, and refuse bad ones alike.

C-contiguous int32 CPU torch tensors are written through their address (``tensor_rows``);
numpy arrays and any other tensor go through DLPack or the buffer protocol. Both paths must
give identical rows and the same typed errors, and a bitmask that could only be filled through
a copy is refused rather than filled in a copy the caller never sees.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from grammar_support import GRAMMARS, INSTANCES, hf_tokenizer, tokenizer_info

from agent_infer.errors import MatcherUsageError, TokenBitmaskError
from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask
from agent_infer.grammar.runtime.bitmask_target import tensor_rows
from agent_infer.grammar.runtime.matcher import GrammarMatcher, fill_next_token_bitmask_batch


@pytest.fixture(scope="module")
def matcher() -> GrammarMatcher:
    info = tokenizer_info("smollm2")
    m = GrammarMatcher(GrammarCompiler(info).compile(GRAMMARS["order"]()))
    ids = hf_tokenizer("smollm2").encode(INSTANCES["order"][0], add_special_tokens=False).ids
    for t in ids[: len(ids) // 2]:
        assert m.accept_token(t)
    return m


def _zeros(kind: str) -> Callable[[int, int], Any]:
    """A zeroed int32 [rows, words] bitmask of one kind: a torch tensor (the address path) or a
    numpy array (the general path)."""
    if kind == "tensor":
        return lambda r, w: torch.zeros((r, w), dtype=torch.int32)
    return lambda r, w: np.zeros((r, w), np.int32)


def _words() -> int:
    return int(allocate_token_bitmask(1, tokenizer_info("smollm2").vocab_size).shape[1])


def test_every_target_gets_the_same_row(matcher: GrammarMatcher) -> None:
    words = _words()
    ref = np.zeros((3, words), np.int32)
    assert matcher.fill_next_token_bitmask(ref, 2)  # numpy: buffer protocol
    tensor = torch.zeros((3, words), dtype=torch.int32)
    assert tensor_rows(tensor) == (tensor.data_ptr(), 3, words, False)
    assert matcher.fill_next_token_bitmask(tensor, 2)  # the address path
    assert np.array_equal(tensor[2].numpy(), ref[2]) and not tensor[:2].any()
    flat = torch.zeros(words, dtype=torch.int32)  # one row
    assert tensor_rows(flat) == (flat.data_ptr(), 1, words, False)
    matcher.fill_next_token_bitmask(flat)
    assert np.array_equal(flat.numpy(), ref[2])
    # A row of a larger buffer: the view's own address (storage offset included).
    big = torch.zeros((5, words), dtype=torch.int32)
    view = big[2:4]
    assert tensor_rows(view) == (big[2].data_ptr(), 2, words, False)
    matcher.fill_next_token_bitmask(view, 1)
    assert np.array_equal(big[3].numpy(), ref[2]) and not big[[0, 1, 2, 4]].any()


def test_bitmasks_a_fill_could_not_reach_are_refused(matcher: GrammarMatcher) -> None:
    """A bitmask the native side could only fill through a copy is an error, never a silently
    dropped mask: rows that are not contiguous, another dtype, a read-only array."""
    words = _words()
    wide = torch.zeros((2, words + 8), dtype=torch.int32)
    strided = wide[:, :words]
    assert tensor_rows(strided) is None
    with pytest.raises(TokenBitmaskError, match="C-contiguous"):
        matcher.fill_next_token_bitmask(strided, 0)
    with pytest.raises(TokenBitmaskError, match="C-contiguous"):
        matcher.fill_next_token_bitmask(np.zeros((2, words + 8), np.int32)[:, :words])
    with pytest.raises(TokenBitmaskError, match="C-contiguous"):
        fill_next_token_bitmask_batch([matcher], strided)
    assert not wide.any()
    for bad in (torch.zeros((2, words), dtype=torch.int64), np.zeros((2, words), np.uint32)):
        assert tensor_rows(bad) is None
        with pytest.raises(TokenBitmaskError, match="int32"):
            matcher.fill_next_token_bitmask(bad)
    frozen = np.zeros((1, words), np.int32)
    frozen.flags.writeable = False
    with pytest.raises(TokenBitmaskError, match="read-only"):
        matcher.fill_next_token_bitmask(frozen)
    with pytest.raises(TokenBitmaskError, match="3 dimensions"):
        matcher.fill_next_token_bitmask(torch.zeros((1, 1, words), dtype=torch.int32))
    # Rows wider than the vocabulary needs are fine on both paths.
    matcher.fill_next_token_bitmask(wide, 1)
    ref = np.zeros((1, words + 8), np.int32)
    matcher.fill_next_token_bitmask(ref)
    assert np.array_equal(wide[1].numpy(), ref[0])


@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_bad_rows_are_refused_on_both_paths(matcher: GrammarMatcher, kind: str) -> None:
    words = _words()
    make = _zeros(kind)
    with pytest.raises(TokenBitmaskError, match="bitmask row 2 is outside the bitmask's 2 rows"):
        matcher.fill_next_token_bitmask(make(2, words), 2)
    with pytest.raises(TokenBitmaskError, match="row -1"):
        matcher.fill_next_token_bitmask(make(2, words), -1)
    with pytest.raises(TokenBitmaskError, match=f"bitmask rows have {words - 1} words"):
        matcher.fill_next_token_bitmask(make(1, words - 1))


def test_batch_fills_reach_every_target_alike(matcher: GrammarMatcher) -> None:
    """The batch call takes the address path for torch tensors too: same rows as numpy."""
    words = _words()
    other = matcher.fork()
    assert other.accept_token(_first_allowed(other, words))
    ref = np.zeros((3, words), np.int32)
    fill_next_token_bitmask_batch([matcher, other], ref, [2, 0])
    tensor = torch.zeros((3, words), dtype=torch.int32)
    assert fill_next_token_bitmask_batch([matcher, other], tensor, [2, 0], num_threads=2) == [True, True]
    assert np.array_equal(tensor.numpy(), ref) and not ref[1].any() and not np.array_equal(ref[0], ref[2])
    flat = torch.zeros(words, dtype=torch.int32)
    fill_next_token_bitmask_batch([other], flat)
    assert np.array_equal(flat.numpy(), ref[0])


@pytest.mark.parametrize("kind", ["tensor", "numpy"])
def test_bad_batches_are_refused_on_both_paths(matcher: GrammarMatcher, kind: str) -> None:
    words = _words()
    make = _zeros(kind)
    other = matcher.fork()
    with pytest.raises(MatcherUsageError, match="the same matcher appears twice"):
        fill_next_token_bitmask_batch([matcher, other, matcher], make(3, words))
    with pytest.raises(TokenBitmaskError, match="2 matchers but 1 indices"):
        fill_next_token_bitmask_batch([matcher, other], make(2, words), [0])
    with pytest.raises(TokenBitmaskError, match="bitmask row 2 is outside the bitmask's 2 rows"):
        fill_next_token_bitmask_batch([matcher, other], make(2, words), [0, 2])
    with pytest.raises(TokenBitmaskError, match=f"bitmask rows have {words - 1} words"):
        fill_next_token_bitmask_batch([matcher], make(1, words - 1))
    untouched = make(2, words)
    with pytest.raises(TokenBitmaskError):
        fill_next_token_bitmask_batch([matcher, other], untouched, [1, 5])
    assert not untouched.any()  # checks run before any row is written


def _first_allowed(m: GrammarMatcher, words: int) -> int:
    row = torch.zeros((1, words), dtype=torch.int32)
    m.fill_next_token_bitmask(row)
    bits = row[0].numpy().view(np.uint32)
    word = int(np.flatnonzero(bits)[0])
    return word * 32 + (int(bits[word]) & -int(bits[word])).bit_length() - 1
