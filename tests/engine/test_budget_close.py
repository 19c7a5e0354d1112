"""Closing pressure near ``max_tokens``: the ramp, where the bias lands, the mask on tokens that leave
the document unclosable, and outputs of the default model that end inside their budget with it."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch

from agent_infer import SamplingParams
from agent_infer.engine.budget_close import budget_window, ramp
from agent_infer.engine.dry import TokenTexts
from agent_infer.engine.penalties import apply_penalties
from agent_infer.engine.sequence import Sequence
from agent_infer.engine.value_loops import ClosingTokens
from agent_infer.errors import InvalidRequestError
from agent_infer.structured import StructuredOutput

CHARS = TokenTexts(lambda ids: "".join(map(chr, ids)))
EOS = 0
BUDGET = {"value_close_budget": 0.25, "value_close_budget_bias": 8.0}


def test_ramp_rises_linearly_over_the_window() -> None:
    assert budget_window(200, 0.25) == 50 and budget_window(3, 0.01) == 1
    assert ramp(50, 50, 8.0) == 0.0 and ramp(80, 50, 8.0) == 0.0
    assert ramp(25, 50, 8.0) == pytest.approx(4.0)
    assert ramp(0, 50, 8.0) == 8.0 and ramp(-3, 50, 8.0) == 8.0


def _seq(n_out: int, **params: Any) -> Sequence:
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=40, **params))
    for _ in range(n_out):
        seq.append_token(ord("a"))
    return seq


def _apply(seqs: list[Sequence], logits: torch.Tensor | None = None) -> torch.Tensor:
    logits = torch.zeros(len(seqs), 128) if logits is None else logits
    return apply_penalties(logits, seqs, (EOS,), CHARS, ClosingTokens(128, CHARS))


def test_without_a_grammar_only_eos_gains_and_only_near_the_end() -> None:
    window = budget_window(40, 0.25)  # 10 tokens
    early, late, off = _seq(40 - 2 * window - 1, **BUDGET), _seq(35, **BUDGET), _seq(35)
    out = _apply([early, late, off])
    assert not bool(out[0].any()) and not bool(out[2].any())
    # 5 tokens left, 1 of them for EOS: slack 4 of 10.
    assert (out[1] != 0).nonzero().flatten().tolist() == [EOS]
    assert float(out[1, EOS]) == pytest.approx(8.0 * (1 - 4 / window))
    # The same row alone gets the same bias; a masked EOS stays masked.
    assert torch.equal(_apply([late])[0], out[1])
    masked = torch.zeros(1, 128)
    masked[0, EOS] = float("-inf")
    assert _apply([late], masked)[0, EOS] == float("-inf")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("value_close_budget", -0.1),
        ("value_close_budget", 1.5),
        ("value_close_budget", float("nan")),
        ("value_close_budget", "late"),
        ("value_close_budget_bias", -1.0),
        ("value_close_budget_bias", float("inf")),
    ],
)
def test_bad_values_name_the_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field


FRUITS = {
    "type": "object",
    "properties": {"fruits": {"type": "array", "items": {"type": "string"}}},
    "required": ["fruits"],
}
CASES = {
    # A list that keeps adding items ("mango", "pineapple", "mango", ...) ends after an item.
    "list": ("List many fruits.", FRUITS, 80),
    # Free text ends at the end of a sentence instead of mid-sentence.
    "text": ("Describe Paris in detail.", None, 60),
}


@pytest.fixture(scope="module")
def engine(make_llm: Callable[..., Any]) -> Any:
    # Prefix caching off: every case computes its prompt the same way whatever ran before.
    return make_llm(enable_prefix_caching=False)


def _request(llm: Any, prompt: str, schema: Any, max_tokens: int, **params: Any) -> Any:
    p = SamplingParams(temperature=0.0, max_tokens=max_tokens, structured=schema, **params)
    return llm.chat([[{"role": "user", "content": prompt}]], p)[0]


def _out(llm: Any, prompt: str, schema: Any, max_tokens: int, **params: Any) -> Any:
    return _request(llm, prompt, schema, max_tokens, **params).outputs[0]


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_end_inside_their_budget(engine: Any, case: str) -> None:
    prompt, schema, max_tokens = CASES[case]
    plain = _out(engine, prompt, schema, max_tokens)
    pressed = _out(engine, prompt, schema, max_tokens, **BUDGET)
    assert plain.finish_reason == "length"
    assert pressed.finish_reason == "stop"
    if schema is not None:
        json.loads(pressed.text)
    else:
        assert pressed.text.rstrip().endswith(".")
    # Nothing changes before the pressure starts (twice the window before the end).
    untouched = max_tokens - 2 * budget_window(max_tokens, BUDGET["value_close_budget"])
    assert pressed.token_ids[:untouched] == plain.token_ids[:untouched]


def test_an_output_that_ends_early_is_not_touched(engine: Any) -> None:
    prompt = "What is the capital of France? Answer in one short sentence."
    plain = _out(engine, prompt, None, 200)
    assert plain.finish_reason == "stop" and len(plain.token_ids) < 100
    assert _out(engine, prompt, None, 200, **BUDGET).token_ids == plain.token_ids


def test_drafts_keep_the_tokens(make_llm: Callable[..., Any]) -> None:
    # Draft rows get the bias and the mask as if the draft prefix were accepted (the matcher walks
    # the draft and is rolled back), so drafting does not change the output.
    base = {"enable_prefix_caching": False, "forced_tokens": False, "boundary_drafts": False}
    plain, spec = make_llm(speculative_tokens=0, **base), make_llm(speculative_tokens=5, **base)
    schema = {
        "type": "object",
        "properties": {"words": {"type": "string"}},
        "required": ["words"],
        "additionalProperties": False,
    }
    prompt = "Write the word 'go' forty times in the words field: go, go, go, go"
    x = _out(plain, prompt, schema, 60, **BUDGET)
    drafted = _request(spec, prompt, schema, 60, **BUDGET)
    assert drafted.metrics.num_draft_tokens > 0
    assert drafted.outputs[0].token_ids == x.token_ids and x.finish_reason == "stop"
    assert _out(plain, prompt, schema, 60).finish_reason == "length"  # the pressure did act


def test_a_likely_token_that_cannot_be_closed_in_time_is_masked(engine: Any) -> None:
    # After "a" the grammar allows the end or thirty "b"s; logit_bias makes the "b"s the model's
    # choice. With 9 tokens left the "b"s cannot be finished, so the mask takes them out and the
    # output ends after "a". The ramp's own bias (0.01) is far too small to do that.
    tok = engine.tokenizer
    only_b = {t: 50.0 for t in range(tok.vocab_size) if tok.decode([t]) and set(tok.decode([t])) == {"b"}}
    grammar = StructuredOutput.regex("a(b{30})?")
    ask = {"temperature": 0.0, "max_tokens": 10, "structured": grammar, "logit_bias": only_b}
    prompt = [[{"role": "user", "content": "Write a."}]]
    plain = engine.chat(prompt, SamplingParams(**ask))[0].outputs[0]
    assert plain.finish_reason == "length" and plain.text.startswith("ab")
    masked = SamplingParams(**ask, value_close_budget=1.0, value_close_budget_bias=0.01)
    out = engine.chat(prompt, masked)[0].outputs[0]
    assert (out.finish_reason, out.text) == ("stop", "a")
