"""SamplingParams validation and the Sampler, without a model."""

from __future__ import annotations

import pytest
import torch

from agent_infer.engine.sampler import Sampler, make_generator
from agent_infer.engine.sequence import Sequence
from agent_infer.errors import InvalidRequestError
from agent_infer.sampling_params import SamplingParams


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"temprature": 0.5}, "temprature"),
        ({"structured": "[a-z]+"}, "structured"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_from_dict_rejects_unknown_keys_and_normalises() -> None:
    with pytest.raises(InvalidRequestError, match="max_token") as info:
        SamplingParams.from_dict({"max_token": 5})
    assert info.value.field == "max_token"
    params = SamplingParams.from_dict({"stop": "\n", "stop_token_ids": [3, 4], "temperature": 0})
    assert params.stop_strings == ("\n",) and params.stop_ids == (3, 4) and params.greedy


def seq_with(params: SamplingParams, name: str = "r") -> Sequence:
    return Sequence(name, [1, 2, 3], params, generator=make_generator(params, torch.device("cpu")))


def test_greedy_picks_argmax() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 1.0]])
    seqs = [seq_with(SamplingParams(temperature=0.0)) for _ in range(2)]
    assert Sampler()(logits, seqs).token_ids == [1, 0]


def test_seeded_sampling_is_batch_invariant() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 500)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234)

    def draws(batch_rows: list[int], target: int) -> list[int]:
        target_seq = seq_with(params, "target")
        others = [seq_with(SamplingParams(temperature=1.0, seed=i), f"o{i}") for i in range(len(batch_rows))]
        out = []
        for _ in range(20):
            seqs = [*others[:target], target_seq, *others[target:]]
            rows = torch.stack([logits[r] for r in [*batch_rows[:target], 0, *batch_rows[target:]]])
            out.append(Sampler()(rows, seqs).token_ids[target])
        return out

    alone = draws([], 0)
    assert draws([1, 2, 3, 4, 5], 2) == alone
    assert draws([5, 4], 1) == alone
    assert len(set(alone)) > 1  # it really samples


def test_top_k_one_is_greedy_and_min_p_filters() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.9, -5.0]])
    for _ in range(10):
        seq = seq_with(SamplingParams(temperature=1.0, top_k=1))
        assert Sampler()(logits, [seq]).token_ids == [1]
    seen = set()
    for seed in range(30):
        seq = seq_with(SamplingParams(temperature=1.0, min_p=0.5, seed=seed))
        seen.update(Sampler()(logits, [seq]).token_ids)
    assert seen == {1, 2}


def test_top_p_keeps_smallest_prefix_covering_mass() -> None:
    # probs ≈ [0.64, 0.24, 0.09, 0.03]: top_p=0.7 keeps the first two tokens only.
    logits = torch.log(torch.tensor([[0.64, 0.24, 0.09, 0.03]]))
    seen = set()
    for seed in range(60):
        seq = seq_with(SamplingParams(temperature=1.0, top_p=0.7, seed=seed))
        seen.update(Sampler()(logits, [seq]).token_ids)
    assert seen == {0, 1}


def test_logprobs_report_sampled_and_top_n() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]])
    seq = seq_with(SamplingParams(temperature=0.0, logprobs=2))
    out = Sampler()(logits, [seq])
    entry = out.logprobs[0]
    assert entry is not None and set(entry) == {1, 3}
    expected = torch.log_softmax(logits[0], -1)
    assert entry[1] == pytest.approx(float(expected[1]))


def test_sampling_frequencies_follow_probabilities() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    seq = seq_with(SamplingParams(temperature=1.0, seed=42))
    draws = [Sampler()(torch.log(probs).unsqueeze(0), [seq]).token_ids[0] for _ in range(2000)]
    freqs = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert torch.allclose(freqs, probs, atol=0.04)


def test_top_p_candidate_set_grows_to_cover_a_flat_nucleus() -> None:
    logits = torch.zeros(1, 1000)  # uniform: top_p=0.9 keeps 900 tokens, far beyond the first 128
    seq = seq_with(SamplingParams(temperature=1.0, top_p=0.9, seed=1))
    draws = {Sampler()(logits, [seq]).token_ids[0] for _ in range(300)}
    assert len(draws) > 128


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 1180591620717411303424])
def test_seed_outside_64_bits_is_a_typed_error(seed: int) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(seed=seed)
    assert info.value.field == "seed"


def test_seeds_at_the_ends_of_the_range_are_taken() -> None:
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
