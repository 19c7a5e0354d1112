"""The value-loop closing bias: which JSON value is open, how much it repeats, which tokens close it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agent_infer import SamplingParams
from agent_infer.engine.dry import TokenTexts
from agent_infer.engine.penalties import apply_penalties
from agent_infer.engine.sequence import Sequence
from agent_infer.engine.value_loops import ClosingTokens, repeated_bigrams, scan, value_close_bias
from agent_infer.errors import InvalidRequestError

# A character-level vocabulary (token id = code point) for the scanning logic.
CHARS = TokenTexts(lambda ids: "".join(map(chr, ids)))


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_scan_tracks_open_values_and_content() -> None:
    texts = ['{"na', 'me": "Ad', 'a \\" x", "tags": [1', ', "a', '"], "k": {"q": "']
    stack, content = scan(texts)
    assert stack == [("{", 0), ("{", 4), ('"', 4)]
    assert content == [False, True, True, True, False]  # keys are not content, values are
    assert scan(['"a\\\\"', "]"])[0] == []  # an escaped backslash does not escape the quote


def test_repeated_bigrams() -> None:
    assert repeated_bigrams([1, 2, 3, 4]) == 0
    assert repeated_bigrams([1, 2, 1, 2, 1, 2]) == 3
    assert repeated_bigrams([]) == 0


def test_a_repeating_string_favours_its_end() -> None:
    looping = _ids('{"email": "ngozi-ngoza-ngozu-ngozw-ngozo-ngoze')
    closer, bias = value_close_bias(looping, 1.0, 4, CHARS) or ("", 0.0)
    assert closer == '"' and bias > 0
    plain = _ids('{"email": "ngozi.okafor@example.com')
    assert value_close_bias(plain, 1.0, 4, CHARS) is None
    # Past the allowance the bias grows with every repeat.
    longer = value_close_bias(looping + _ids("-ngoza-ngozu"), 1.0, 4, CHARS)
    assert longer is not None and longer[1] > bias


def test_a_repeating_list_favours_its_bracket_and_keys_do_not_count() -> None:
    dates = '{"dates": [' + ", ".join(f'"20{i:02d}-12-24"' for i in range(20, 8, -1))
    found = value_close_bias(_ids(dates), 1.0, 4, CHARS)
    assert found is not None and found[0] == "]"
    # Many members with the same key shapes but different values are not a loop.
    members = (
        "{" + ", ".join(f'"k{i}": "{w}"' for i, w in enumerate(["red", "blue", "green", "sky", "fog"])) + ", "
    )
    assert value_close_bias(_ids(members), 1.0, 4, CHARS) is None


def test_closing_tokens_on_the_real_vocabulary(llm: Any) -> None:
    engine = llm.engine
    texts = TokenTexts(engine.tokenizer.decode)
    closing = ClosingTokens(engine.tokenizer.vocab_size, texts)
    for closer in ('"', "]", "}"):
        ids = closing.ids(closer).tolist()
        assert ids and all(
            texts.text(t).lstrip(" \t\r\n" if closer != '"' else "").startswith(closer) for t in ids
        )


def _seq(output: str, **params: Any) -> Sequence:
    seq = Sequence("r", [1, 2], SamplingParams(max_tokens=500, **params))
    for t in _ids(output):
        seq.append_token(t)
    return seq


def test_bias_lands_on_closers_only_and_per_row() -> None:
    closing = ClosingTokens(256, CHARS)
    looping = '{"email": "ngozi-ngoza-ngozu-ngozw-ngozo-ngoze'
    on = _seq(looping, value_close_multiplier=2.0)
    off = _seq(looping)
    logits = torch.zeros(2, 256)
    out = apply_penalties(logits, [on, off], (), CHARS, closing)
    changed = (out[0] != 0).nonzero().flatten().tolist()
    assert changed == [ord('"')] and float(out[0, ord('"')]) > 0
    assert not bool(out[1].any())
    # The same row alone, or second in the batch, gets the same bias.
    alone = apply_penalties(torch.zeros(1, 256), [on], (), CHARS, closing)
    swapped = apply_penalties(torch.zeros(2, 256), [off, on], (), CHARS, closing)
    assert torch.equal(alone[0], out[0]) and torch.equal(swapped[1], out[0])
    masked = torch.zeros(1, 256)
    masked[0, ord('"')] = float("-inf")
    assert apply_penalties(masked, [on], (), CHARS, closing)[0, ord('"')] == float("-inf")


@pytest.mark.parametrize(
    ("field", "value"),
    [("value_close_multiplier", -1.0), ("value_close_multiplier", float("inf")), ("value_close_allowed", -1)],
)
def test_bad_values_name_the_field(field: str, value: float) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
