"""Misusing a matcher or a bitmask raises a typed error naming the argument, never a builtin
``IndexError``/``ValueError``/``TypeError``/``UnicodeEncodeError``/``OverflowError``, and never
an argument silently taken for another (a float row index, a token id past int32)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from agent_infer.errors import MatcherUsageError, TokenBitmaskError
from agent_infer.grammar import Grammar, TokenizerInfo
from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask, apply_token_bitmask_inplace
from agent_infer.grammar.runtime.matcher import (
    BatchGrammarMatcher,
    GrammarMatcher,
    fill_next_token_bitmask_batch,
)


@pytest.fixture(scope="module")
def bytes_matcher() -> GrammarMatcher:
    compiled = GrammarCompiler(TokenizerInfo.bytes_only()).compile(Grammar.from_ebnf('root ::= "ab" | "abc"'))
    return GrammarMatcher(compiled)


BAD_TOKENS = [-1, 257, 2**31, -(2**31) - 1, 2**70, "1", 1.0, None]


@pytest.mark.parametrize("token", BAD_TOKENS, ids=repr)
def test_bad_token_ids(bytes_matcher: GrammarMatcher, token: object) -> None:
    with pytest.raises(MatcherUsageError, match="token_id") as err:
        bytes_matcher.accept_token(token)  # type: ignore[arg-type]
    assert err.value.argument == "token_id" and bytes_matcher.num_accepted_steps == 0
    with pytest.raises(MatcherUsageError, match="token_id"):
        BatchGrammarMatcher([bytes_matcher]).accept_tokens([token])  # type: ignore[list-item]


def test_integer_scalars_are_token_ids(bytes_matcher: GrammarMatcher) -> None:
    assert bytes_matcher.accept_token(np.int64(ord("a")))  # type: ignore[arg-type]
    bytes_matcher.rollback(np.int32(1))  # type: ignore[arg-type]
    assert bytes_matcher.num_accepted_steps == 0


@pytest.mark.parametrize("text", ["\ud800", "a\udfffb", 5, None, ["a"]], ids=repr)
def test_bad_text(bytes_matcher: GrammarMatcher, text: object) -> None:
    with pytest.raises(MatcherUsageError, match="text"):
        bytes_matcher.accept_string(text)  # type: ignore[arg-type]
    assert bytes_matcher.num_accepted_steps == 0


@pytest.mark.parametrize("n", [-1, 2, 2**40, 1.5, "1", None], ids=repr)
def test_bad_rollbacks(bytes_matcher: GrammarMatcher, n: object) -> None:
    m = bytes_matcher.fork()
    assert m.accept_string("a")
    with pytest.raises(MatcherUsageError, match=r"num_tokens|roll back"):
        m.rollback(n)  # type: ignore[arg-type]
    assert m.num_accepted_steps == 1


@pytest.mark.parametrize(
    "kwargs",
    [
        {"compiled_grammar": None},
        {"compiled_grammar": "root ::= x"},
        {"max_rollback_tokens": -2},
        {"max_rollback_tokens": 1.0},
    ],
    ids=repr,
)
def test_bad_constructor_arguments(bytes_matcher: GrammarMatcher, kwargs: dict[str, Any]) -> None:
    args = {"compiled_grammar": bytes_matcher.compiled_grammar, **kwargs}
    with pytest.raises(MatcherUsageError, match=next(iter(kwargs))):
        GrammarMatcher(**args)


@pytest.mark.parametrize(
    ("make", "index"),
    [
        (lambda w: allocate_token_bitmask(2, 257), 2),
        (lambda w: allocate_token_bitmask(2, 257), -1),
        (lambda w: allocate_token_bitmask(2, 257), 2**70),
        (lambda w: allocate_token_bitmask(2, 257), 1.0),
        (lambda w: np.zeros((2, w), np.int32), "0"),
        (lambda w: allocate_token_bitmask(1, 200), 0),
        (lambda w: np.zeros((1, w), np.int64), 0),
        (lambda w: torch.zeros((1, w), dtype=torch.float32), 0),
        (lambda w: torch.zeros((1, 1, w), dtype=torch.int32), 0),
        (lambda w: torch.zeros((0, w), dtype=torch.int32), 0),
        (lambda w: None, 0),
        (lambda w: [[0] * w], 0),
    ],
)
def test_bad_bitmasks_and_rows(
    bytes_matcher: GrammarMatcher, make: Callable[[int], Any], index: object
) -> None:
    with pytest.raises(TokenBitmaskError):
        bytes_matcher.fill_next_token_bitmask(make(9), index)  # type: ignore[arg-type]
    if not isinstance(index, int) or 0 <= index < 2**31:
        with pytest.raises(TokenBitmaskError):
            fill_next_token_bitmask_batch([bytes_matcher], make(9), [index])  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("indices", "error"),
    [
        ([0.0], TokenBitmaskError),
        ([1.5], TokenBitmaskError),
        (["0"], TokenBitmaskError),
        ([5], TokenBitmaskError),
        ([-1], TokenBitmaskError),
        ([2**70], TokenBitmaskError),
        (3, TokenBitmaskError),
        ([0, 1], TokenBitmaskError),
    ],
    ids=repr,
)
def test_bad_batch_indices(bytes_matcher: GrammarMatcher, indices: Any, error: type[Exception]) -> None:
    bitmask = torch.zeros((2, 9), dtype=torch.int32)
    with pytest.raises(error):
        fill_next_token_bitmask_batch([bytes_matcher], bitmask, indices)
    with pytest.raises(error):
        BatchGrammarMatcher([bytes_matcher]).fill_next_token_bitmask(bitmask, indices)
    assert not bitmask.any()  # nothing written before the checks


def test_bad_batch_matchers(bytes_matcher: GrammarMatcher) -> None:
    bitmask = allocate_token_bitmask(2, 257)
    with pytest.raises(MatcherUsageError, match="appears twice"):
        fill_next_token_bitmask_batch([bytes_matcher, bytes_matcher], bitmask)
    with pytest.raises(MatcherUsageError, match=r"matchers\[1\] is a NoneType"):
        fill_next_token_bitmask_batch([bytes_matcher, None], bitmask)  # type: ignore[list-item]
    for threads in (-1, "2", 1.5):
        with pytest.raises(MatcherUsageError, match="num_threads"):
            fill_next_token_bitmask_batch([bytes_matcher], bitmask, num_threads=threads)  # type: ignore[arg-type]


@pytest.mark.parametrize(("batch", "vocab"), [(-1, 10), (1, 0), (1.5, 10), ("2", 10), (1, 2**31), (True, 10)])
def test_bad_allocations(batch: object, vocab: object) -> None:
    with pytest.raises(TokenBitmaskError):
        allocate_token_bitmask(batch, vocab)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("logits", "bitmask", "indices"),
    [
        (None, allocate_token_bitmask(1, 64), None),
        (torch.zeros(2, 64), torch.zeros(2, 2), None),
        (torch.zeros(2, 64), allocate_token_bitmask(1, 64), None),
        (torch.zeros(2, 64), allocate_token_bitmask(2, 64), 5),
        (torch.zeros(2, 64), allocate_token_bitmask(2, 64), [0.5]),
        (torch.zeros(2, 64), allocate_token_bitmask(2, 64), [2]),
        (torch.zeros(2, 64), allocate_token_bitmask(2, 64), torch.tensor([0.0])),
    ],
)
def test_bad_mask_applications(logits: Any, bitmask: Any, indices: Any) -> None:
    with pytest.raises(TokenBitmaskError):
        apply_token_bitmask_inplace(logits, bitmask, indices)


def test_integer_scalar_indices_apply() -> None:
    logits = torch.zeros(2, 64)
    bitmask = torch.zeros((2, 2), dtype=torch.int32)
    apply_token_bitmask_inplace(logits, bitmask, np.array([1]))
    assert torch.isinf(logits[1]).all() and not torch.isinf(logits[0]).any()
