"""The DRY penalty: its math against a direct reference, validation, and what the engine does with it
(batch invariance, seeded determinism, the off-switch) on the default model."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from agent_infer.engine.dry import TokenTexts, dry_penalties, z_function
from agent_infer.engine.sampler import Sampler
from agent_infer.engine.sequence import Sequence
from agent_infer.errors import InvalidRequestError
from agent_infer.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(loaded_model: Any) -> Any:
    return loaded_model.tokenizer


def reference_dry(output: list[int], p: SamplingParams, text: Any) -> dict[int, float]:
    """DRY written the obvious way: for every earlier position, walk back while it matches the end."""
    window = output if p.dry_penalty_last_n < 0 else output[-p.dry_penalty_last_n :]
    if p.dry_skip_whitespace:
        window = [t for t in window if text(t).strip()]
    breakers = p.dry_sequence_breakers or ()

    def is_breaker(t: int) -> bool:
        return any(b in text(t) for b in breakers)

    n = len(window)
    best: dict[int, int] = {}
    for j in range(n - 1):
        m = 0
        while m <= j and window[j - m] == window[n - 1 - m] and not is_breaker(window[n - 1 - m]):
            m += 1
        if m >= p.dry_allowed_length:
            cand = window[j + 1]
            best[cand] = max(best.get(cand, 0), m)
    out = {}
    for t, m in best.items():
        if is_breaker(t):
            continue
        exp = m - p.dry_allowed_length
        if p.dry_base > 1.000001:
            exp = min(exp, int(88.7228391 / math.log(p.dry_base)))
        out[t] = p.dry_multiplier * p.dry_base**exp
    return out


def test_z_function_matches_its_definition() -> None:
    rng = random.Random(0)
    for _ in range(200):
        s = [rng.randrange(3) for _ in range(rng.randrange(0, 30))]
        expected = []
        for i in range(len(s)):
            k = 0
            while i + k < len(s) and s[k] == s[i + k]:
                k += 1
            expected.append(k)
        assert z_function(s) == expected


def test_hand_computed_penalty(tokenizer: Any) -> None:
    a, b, c = (tokenizer.encode(w)[0] for w in ("apple", "banana", "cherry"))
    texts = TokenTexts(tokenizer.decode)
    p = SamplingParams(dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2, dry_sequence_breakers=[])
    # "a b c a b": the end "a b" occurred before, followed by c: a repeat of 2, penalty 1 * 2**0.
    assert dry_penalties([a, b, c, a, b], p, texts) == {c: 1.0}
    # "a b c a b c a b": the repeat "a b c a b" (5 tokens, overlapping) continues with c: 2**3.
    assert dry_penalties([a, b, c, a, b, c, a, b], p, texts) == {c: 8.0}
    # Below allowed_length nothing is penalized.
    assert dry_penalties([a, b, c, a], p, texts) == {}
    # A base too large for a float power bans the token (llama.cpp's float pow gives inf) instead of raising.
    huge = SamplingParams(dry_multiplier=1.0, dry_base=1e300, dry_allowed_length=2, dry_sequence_breakers=[])
    assert dry_penalties([a, b, c, a, b, c, a, b], huge, texts) == {c: math.inf}


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"dry_sequence_breakers": []},
        {"dry_allowed_length": 1, "dry_base": 1.3},
        {"dry_allowed_length": 4, "dry_penalty_last_n": 12},
        {"dry_skip_whitespace": True, "dry_sequence_breakers": []},
        {"dry_skip_whitespace": True, "dry_base": 3.0, "dry_allowed_length": 1},
        {"dry_base": 1.0},
        {"dry_base": 400.0, "dry_allowed_length": 1, "dry_sequence_breakers": []},  # exponent clamp
    ],
)
def test_matches_reference_on_real_tokens(tokenizer: Any, params: dict[str, Any]) -> None:
    pool = tokenizer.encode('ab cd "x": 12\n  1 1')
    pool += tokenizer.encode("  ") + tokenizer.encode("\n    ")
    texts = TokenTexts(tokenizer.decode)
    p = SamplingParams(dry_multiplier=0.8, **params)
    rng = random.Random(7)
    for _ in range(300):
        seq = [rng.choice(pool[: rng.randrange(2, len(pool) + 1)]) for _ in range(rng.randrange(0, 40))]
        got = dry_penalties(seq, p, texts)
        want = reference_dry(seq, p, texts.text)
        assert got.keys() == want.keys()
        for t in want:
            assert got[t] == pytest.approx(want[t], rel=1e-12)


def test_sampler_subtracts_and_keeps_masked_tokens(tokenizer: Any, loaded_model: Any) -> None:
    a, b, c = (tokenizer.encode(w)[0] for w in ("apple", "banana", "cherry"))
    p = SamplingParams(
        temperature=0, dry_multiplier=5.0, dry_allowed_length=2, dry_sequence_breakers=[], max_tokens=20
    )
    seq = Sequence("r", [1, 2], p)
    for t in (a, b, c, a, b):
        seq.append_token(t)
    vocab = loaded_model.config.vocab_size
    logits = torch.zeros(1, vocab)
    logits[0, c] = 3.0  # the repeat's continuation: 3 - 5 loses to the 0.5 below
    logits[0, a] = 0.5
    logits[0, b] = float("-inf")
    sampler = Sampler((), tokenizer.decode)
    assert sampler(logits, [seq]).token_ids == [a]
    off = Sequence("s", [1, 2], SamplingParams(temperature=0, max_tokens=20))
    for t in (a, b, c, a, b):
        off.append_token(t)
    assert sampler(logits, [off]).token_ids == [c]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dry_multiplier": -0.1}, "dry_multiplier"),
        ({"dry_multiplier": float("inf")}, "dry_multiplier"),
        ({"dry_multiplier": "1"}, "dry_multiplier"),
        ({"dry_base": 0.9}, "dry_base"),
        ({"dry_base": float("nan")}, "dry_base"),
        ({"dry_allowed_length": 0}, "dry_allowed_length"),
        ({"dry_allowed_length": 2.5}, "dry_allowed_length"),
        ({"dry_penalty_last_n": -2}, "dry_penalty_last_n"),
        ({"dry_sequence_breakers": [""]}, "dry_sequence_breakers"),
        ({"dry_sequence_breakers": [1]}, "dry_sequence_breakers"),
        ({"dry_sequence_breakers": ["x"] * 65}, "dry_sequence_breakers"),
        ({"dry_skip_whitespace": 1}, "dry_skip_whitespace"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == field


def test_defaults_follow_llama_cpp() -> None:
    p = SamplingParams()
    assert (p.dry_multiplier, p.dry_base, p.dry_allowed_length, p.dry_penalty_last_n) == (0.0, 1.75, 2, -1)
    assert p.dry_sequence_breakers == ("\n", ":", '"', "*")
    assert not p.dry and not p.penalized
    assert SamplingParams(dry_multiplier=0.5).penalized
    assert not SamplingParams(dry_multiplier=0.5, dry_penalty_last_n=0).dry


# A prompt on which the default model repeats itself within a few dozen greedy tokens.
LOOPY = [{"role": "user", "content": "Count the word 'go' forty times: go go go"}]
DRY = {"dry_multiplier": 0.8, "dry_allowed_length": 2}


def _tokens(llm: Any, prompts: list[Any], params: list[SamplingParams]) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in llm.chat(prompts, params)]


def test_penalty_changes_the_loop_and_off_is_exact(llm: Any) -> None:
    plain = _tokens(llm, [LOOPY], [SamplingParams(temperature=0, max_tokens=48)])[0]
    off = _tokens(llm, [LOOPY], [SamplingParams(temperature=0, max_tokens=48, dry_multiplier=0.0)])[0]
    on = _tokens(llm, [LOOPY], [SamplingParams(temperature=0, max_tokens=48, **DRY)])[0]
    no_window = _tokens(
        llm, [LOOPY], [SamplingParams(temperature=0, max_tokens=48, dry_penalty_last_n=0, **DRY)]
    )[0]
    assert off == plain and no_window == plain
    assert on != plain


def test_batch_invariant_and_seeded(llm: Any) -> None:
    others = [
        [{"role": "user", "content": "Write a haiku about rain."}],
        [{"role": "user", "content": "List three colours."}],
        [{"role": "user", "content": "Say hello in French, again and again."}],
    ]
    for base in (
        SamplingParams(temperature=0, max_tokens=40, **DRY),
        SamplingParams(temperature=0.7, seed=11, max_tokens=40, **DRY),
    ):
        alone = _tokens(llm, [LOOPY], [base])[0]
        other_params = [
            SamplingParams(temperature=0.9, seed=3, max_tokens=30, dry_multiplier=1.5),
            SamplingParams(temperature=0, max_tokens=30),
            SamplingParams(temperature=0.5, seed=5, max_tokens=30, **DRY),
        ]
        batch = _tokens(llm, [*others, LOOPY], [*other_params, base])
        assert batch[3] == alone
        assert _tokens(llm, [LOOPY], [base])[0] == alone  # same seed, same output


def test_drafts_verify_against_penalized_rows(make_llm: Any, llm: Any) -> None:
    """With drafts (the default engine) a DRY request decodes exactly as without them."""
    plain = make_llm(speculative_tokens=0, boundary_drafts=False)
    prompts = [
        LOOPY,
        [{"role": "user", "content": "Repeat after me five times: the cat sat on the mat."}],
    ]
    for params in (
        SamplingParams(temperature=0, max_tokens=60, **DRY),
        SamplingParams(temperature=0.8, seed=2, max_tokens=60, **DRY),
    ):
        assert _tokens(llm, prompts, [params] * 2) == _tokens(plain, prompts, [params] * 2)
