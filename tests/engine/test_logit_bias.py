"""logit_bias and min_tokens in SamplingParams and the sampler (real Sampler, real sequences)."""

from __future__ import annotations

import pytest
import torch

from agent_infer.engine.sampler import Sampler
from agent_infer.engine.sequence import Sequence
from agent_infer.errors import InvalidRequestError
from agent_infer.sampling_params import SamplingParams

EOS = 3


def _pick(logits: list[float], **params: object) -> int:
    seq = Sequence("r", [1, 2], SamplingParams(temperature=0.0, max_tokens=8, **params))  # type: ignore[arg-type]
    return Sampler([EOS])(torch.tensor([logits]), [seq]).token_ids[0]


def test_logit_bias_moves_the_choice() -> None:
    logits = [0.0, 5.0, 1.0, 0.0]
    assert _pick(logits) == 1
    assert _pick(logits, logit_bias={1: -100}) == 2
    assert _pick(logits, logit_bias={0: 100}) == 0


def test_bias_never_unmasks_a_grammar_masked_token() -> None:
    assert _pick([float("-inf"), 5.0, 1.0, 0.0], logit_bias={0: 100}) == 1


def test_min_tokens_bans_eos_and_stop_ids_unless_only_the_end_is_left() -> None:
    assert _pick([0.0, 1.0, 2.0, 9.0], min_tokens=2, stop_token_ids=[2]) == 1
    assert _pick([0.0, 1.0, 2.0, 9.0]) == EOS
    # A grammar that only allows the end: the ban is lifted rather than leaving nothing to sample.
    assert _pick([float("-inf"), float("-inf"), float("-inf"), 0.0], min_tokens=2) == EOS


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"logit_bias": {1: 101}}, "logit_bias.1"),
        ({"logit_bias": {-1: 1}}, "logit_bias.-1"),
        ({"logit_bias": {True: 1}}, "logit_bias.True"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias.1"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 9}, "min_tokens"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(max_tokens=8, **kwargs)  # type: ignore[arg-type]
    assert caught.value.field == field


def test_params_stay_hashable_with_a_bias() -> None:
    assert hash(SamplingParams(logit_bias={5: 1.5, 2: -1})) == hash(
        SamplingParams(logit_bias={2: -1, 5: 1.5})
    )
