"""The value-loop closing bias: which JSON value is open, how much it repeats, which tokens close it."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from agent_infer import SamplingParams
from agent_infer.engine.dry import TokenTexts
from agent_infer.engine.penalties import apply_penalties
from agent_infer.engine.sequence import Sequence
from agent_infer.engine.value_loops import ClosingTokens, ValueScanner, value_close_bias
from agent_infer.errors import InvalidRequestError

# A character-level vocabulary (token id = code point) for the scanning logic.
CHARS = TokenTexts(lambda ids: "".join(map(chr, ids)))


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def _bias(text: str, multiplier: float = 1.0, allowed: int = 4) -> tuple[str, float] | None:
    return value_close_bias(ValueScanner(), _ids(text), multiplier, allowed, CHARS)


def test_scanner_tracks_open_values_and_counts_content_only() -> None:
    scanner = ValueScanner()
    texts = ['{"na', 'me": "Ad', 'a \\" x", "tags": [1', ', "a', '"], "k": {"q": "']
    for i, text in enumerate(texts):
        scanner.feed(i, text)
    assert [f.kind for f in scanner.frames] == ["{", "{", '"']
    # Content (string values, numbers) counted by the outer object: tokens 1, 2, 3; not the keys.
    assert scanner.frames[0].last == 3
    closed = ValueScanner()
    for i, text in enumerate(['"a\\\\"', "]"]):
        closed.feed(i, text)
    assert closed.frames == []  # an escaped backslash does not escape the quote


def test_a_repeating_string_favours_its_end() -> None:
    looping = '{"email": "ngozi-ngoza-ngozu-ngozw-ngozo-ngoze'
    closer, bias = _bias(looping) or ("", 0.0)
    assert closer == '"' and bias > 0
    assert _bias('{"email": "ngozi.okafor@example.com') is None
    # Past the allowance the bias grows with every repeat.
    longer = _bias(looping + "-ngoza-ngozu")
    assert longer is not None and longer[1] > bias


def test_a_repeating_list_favours_its_bracket_and_keys_do_not_count() -> None:
    dates = '{"dates": [' + ", ".join(f'"20{i:02d}-12-24"' for i in range(20, 8, -1))
    found = _bias(dates)
    assert found is not None and found[0] == "]"
    # Many members with the same key shapes but different values are not a loop.
    words = ["red", "blue", "green", "sky", "fog"]
    members = "{" + ", ".join(f'"k{i}": "{w}"' for i, w in enumerate(words)) + ", "
    assert _bias(members) is None


def test_incremental_scanning_matches_a_fresh_scan() -> None:
    text = (
        '{"dates": ['
        + ", ".join(f'"20{i:02d}-12-24"' for i in range(20, 8, -1))
        + '], "e": "ab-ab-ab-ab-ab-ab'
    )
    ids = _ids(text)
    scanner = ValueScanner()
    for n in range(1, len(ids) + 1):
        step = value_close_bias(scanner, ids[:n], 1.0, 4, CHARS)
        assert step == value_close_bias(ValueScanner(), ids[:n], 1.0, 4, CHARS)
    assert scanner.fed == len(ids)


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
