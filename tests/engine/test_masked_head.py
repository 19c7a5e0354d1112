"""The masked output projection: constrained steps skip the head weights of tokens no row allows.

On the real default model: greedy and sampled outputs (JSON Schema, regex, choice; with and without
prompt-lookup drafts; constrained and unconstrained requests in one batch) are token-for-token the
same with ``masked_head`` on and off, and the head really did skip weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from agent_infer import SamplingParams
from agent_infer.model.layers import qlinear
from agent_infer.structured import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0},
        "pet": {"enum": ["cat", "dog", "parrot"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "pet", "active"],
    "additionalProperties": False,
}


def _prompt(llm: Any, text: str) -> str:
    tok = llm.engine.tokenizer
    return tok.apply_chat_template([{"role": "user", "content": text}])


def _requests(llm: Any, temperature: float) -> tuple[list[str], list[SamplingParams]]:
    cases: list[tuple[str, StructuredOutput | None]] = [
        ("Describe a person and their pet as JSON.", StructuredOutput.json_schema(SCHEMA)),
        ("Give a US phone number.", StructuredOutput.regex(r"\(\d{3}\) \d{3}-\d{4}")),
        ("Is the sky blue? Answer yes or no.", StructuredOutput.choice(["yes", "no", "maybe"])),
        ("Write one sentence about the sea.", None),
    ]
    prompts = [_prompt(llm, text) for text, _ in cases]
    params = [
        SamplingParams(temperature=temperature, seed=7, max_tokens=48, structured=so) for _, so in cases
    ]
    return prompts, params


@pytest.fixture
def head_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """Share of logits the masked head left at -inf, per call."""
    shares: list[float] = []
    original = qlinear.QuantLinear.forward_allowed

    def spy(self: qlinear.QuantLinear, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        out = original(self, x, allowed)
        shares.append(float(torch.isinf(out).float().mean()))
        return out

    monkeypatch.setattr(qlinear.QuantLinear, "forward_allowed", spy)
    yield shares


@pytest.mark.parametrize("speculative_tokens", [0, 5])
def test_masked_head_changes_no_token(
    make_llm: Callable[..., Any], head_calls: list[float], speculative_tokens: int
) -> None:
    on = make_llm(masked_head=True, speculative_tokens=speculative_tokens)
    off = make_llm(masked_head=False, speculative_tokens=speculative_tokens)
    for temperature in (0.0, 0.9):
        prompts, params = _requests(on, temperature)
        # One batch (mixed constrained and unconstrained) and each request alone.
        batched_on = on.generate(prompts, params)
        batched_off = off.generate(prompts, params)
        for a, b in zip(batched_on, batched_off):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids, (a.outputs[0].text, b.outputs[0].text)
        for prompt, p, b in zip(prompts, params, batched_off):
            alone = on.generate([prompt], [p])[0]
            assert alone.outputs[0].token_ids == b.outputs[0].token_ids
    # The head ran masked and skipped most weights on some steps (digits, enums, punctuation).
    assert head_calls and max(head_calls) > 0.5


def test_masked_head_off_never_calls_the_masked_path(
    make_llm: Callable[..., Any], head_calls: list[float]
) -> None:
    llm = make_llm(masked_head=False)
    prompts, params = _requests(llm, 0.0)
    llm.generate(prompts[:1], params[:1])
    assert head_calls == []
