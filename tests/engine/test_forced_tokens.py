"""Jump-forward (forced tokens) and termination of constrained requests on the real default model."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from agent_infer import SamplingParams
from agent_infer.grammar.ir import Grammar
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer
from agent_infer.grammar.runtime.matcher import GrammarMatcher
from agent_infer.structured import StructuredOutput

SCHEMAS: list[dict[str, Any]] = [
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "rank": {"type": "integer", "minimum": 1},
        },
        "required": ["city", "rank"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "species": {"enum": ["cat", "dog", "bird"]},
            "vaccinated": {"type": "boolean"},
        },
        "required": ["name", "species", "vaccinated"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "status": {"enum": ["in_progress", "completed", "cancelled"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
        },
        "required": ["status", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "owner": {
                "type": "object",
                "properties": {"first_name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
                "required": ["first_name", "age"],
                "additionalProperties": False,
            }
        },
        "required": ["owner"],
        "additionalProperties": False,
    },
]
PROMPTS = [
    "Name a big city and its rank as JSON.",
    "Describe a pet as JSON.",
    "Give the status of a software task as JSON.",
    "Describe the owner of a pet as JSON.",
]


def _chat(llm: Any, temperature: float) -> list[Any]:
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    params = [
        SamplingParams(temperature=temperature, seed=5, max_tokens=96, structured=schema)
        for schema in SCHEMAS
    ]
    return list(llm.chat(convs, params))


def _forced_consistent(llm: Any, schema: dict[str, Any], tokens: list[int]) -> bool:
    """Would jump-forward have appended exactly the tokens greedy decoding chose here?

    Replays ``tokens`` the way the engine jumps: the grammar's leading forced tokens are prefilled
    with the prompt, and after each sampled token its forced tokens are appended. If the sampled
    text always agrees with them, forced-on greedy decoding sees the same tokens and must produce
    the same output.
    """
    matcher = GrammarMatcher(llm.engine.grammar.compile(Grammar.from_json_schema(schema)))
    pos = 0
    forced = matcher.forced_tokens()
    while True:
        if forced and pos < len(tokens):
            if tokens[pos : pos + len(forced)] != forced:
                return False
            assert all(matcher.accept_token(t) for t in forced)
            pos += len(forced)
        if pos >= len(tokens):
            return True
        assert matcher.accept_token(tokens[pos])
        pos += 1
        forced = matcher.forced_tokens()


def _assert_valid(outs: list[Any]) -> None:
    for schema, out in zip(SCHEMAS, outs):
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        jsonschema.validate(value, schema)
        assert out.outputs[0].parsed == value


def test_forced_on_and_off_both_valid_and_greedy_agrees(make_llm: Callable[..., Any]) -> None:
    on, off = make_llm(forced_tokens=True), make_llm(forced_tokens=False)
    greedy_on, greedy_off = _chat(on, 0.0), _chat(off, 0.0)
    for outs in (greedy_on, greedy_off, _chat(on, 0.8), _chat(off, 0.8)):
        _assert_valid(outs)
    assert all(o.metrics.num_forced_tokens == 0 for o in greedy_off)
    assert sum(o.metrics.num_forced_tokens for o in greedy_on) > 0  # jump-forward actually happened
    consistent = 0
    for schema, a, b in zip(SCHEMAS, greedy_on, greedy_off):
        if _forced_consistent(off, schema, b.token_ids):
            consistent += 1
            assert a.token_ids == b.token_ids, (a.text, b.text)
        # Otherwise greedy decoding spelled a forced span with other tokens (e.g. "v"+"ac"+"ci"
        # instead of "vaccinated"); the canonical tokens change what the model sees afterwards, so
        # the outputs may differ, and only validity (checked above) is required.
    assert consistent >= 1, "no schema where the forced tokens match greedy decoding: test checks nothing"


def test_forced_tokens_respect_max_tokens(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(forced_tokens=True)
    schema = {
        "type": "object",
        "properties": {"a_rather_long_property_name_to_force": {"type": "integer"}},
        "required": ["a_rather_long_property_name_to_force"],
        "additionalProperties": False,
    }
    grammar = StructuredOutput.json_schema(schema).to_grammar()
    for limit in (1, 2, 3, 5):
        out = llm.generate("JSON:", SamplingParams(temperature=0, max_tokens=limit, structured=schema))[0]
        assert len(out.token_ids) <= limit
        if out.finish_reason == "length":
            assert len(out.token_ids) == limit
            assert ReferenceRecognizer(grammar).is_prefix(out.text)


def test_grammar_end_stops_without_eos_text(llm: Any) -> None:
    choice = ["alpha", "beta"]
    pattern = r"(yes|no)!"
    outs = llm.generate(
        ["Pick one:", "Answer:"],
        [
            SamplingParams(temperature=0, max_tokens=16, structured=choice),
            SamplingParams(temperature=0, max_tokens=16, structured=StructuredOutput.regex(pattern)),
        ],
    )
    eos = llm.engine.eos_token_ids
    assert outs[0].finish_reason == "stop" and outs[0].text in choice
    assert outs[1].finish_reason == "stop" and re.fullmatch(pattern, outs[1].text)
    for out in outs:
        assert out.token_ids[-1] in eos  # EOS ends the grammar but adds no text
        assert "<|" not in out.text


def test_builtin_ebnf_outputs_are_accepted(llm: Any) -> None:
    names = ["arithmetic", "sql_select"]
    prompts = ["Write an arithmetic expression:", "Write a SQL query that lists all users:"]
    params = [
        SamplingParams(temperature=t, seed=9, max_tokens=48, structured=StructuredOutput.builtin(n))
        for n in names
        for t in (0.0, 0.8)
    ]
    outs = llm.generate([p for p in prompts for _ in (0, 1)], params)
    for i, out in enumerate(outs):
        recognizer = ReferenceRecognizer(Grammar.builtin(names[i // 2]))
        if out.finish_reason == "stop":
            assert recognizer.accepts(out.text), out.text
        else:
            assert out.finish_reason == "length" and recognizer.is_prefix(out.text), out.text


def test_logprob_requests_sample_every_token(llm: Any) -> None:
    out = llm.chat(
        [{"role": "user", "content": "Describe a pet as JSON."}],
        SamplingParams(temperature=0, max_tokens=64, logprobs=0, structured=SCHEMAS[1]),
    )[0]
    assert out.metrics.num_forced_tokens == 0
    assert out.outputs[0].logprobs is not None and len(out.outputs[0].logprobs) == len(out.token_ids)


@pytest.mark.parametrize("extra", ["   ", "\n\n", "\t\t\t", "\n" + " " * 41])
def test_json_whitespace_is_bounded_by_default(llm: Any, extra: str) -> None:
    compiled = llm.engine.grammar.compile(StructuredOutput.json_schema(SCHEMAS[0]).to_grammar())
    ok = GrammarMatcher(compiled)
    assert ok.accept_string("{  ")  # up to two blanks at an optional spot
    matcher = GrammarMatcher(compiled)
    assert not matcher.accept_string("{" + extra)


def test_stop_string_inside_forced_text(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(forced_tokens=True)
    out = llm.chat(
        [{"role": "user", "content": "Name a big city and its rank as JSON."}],
        SamplingParams(temperature=0, max_tokens=64, stop=['"rank"'], structured=SCHEMAS[0]),
    )[0]
    assert out.finish_reason == "stop"
    assert '"rank"' not in out.text and out.text.startswith("{")
    assert out.outputs[0].parsed is None  # cut short of a complete document
    assert ReferenceRecognizer(StructuredOutput.json_schema(SCHEMAS[0]).to_grammar()).is_prefix(out.text)


def _record_forwards(llm: Any) -> list[list[int]]:
    """Tokens each sequence feeds per forward pass, recorded from the engine's model runner."""
    calls: list[list[int]] = []
    runner = llm.engine.runner
    run = runner.run

    def recording(batch: Any, *args: Any) -> Any:
        calls.append([item.num_new_tokens for item in batch])
        return run(batch, *args)

    runner.run = recording
    return calls


COMPACT_CITY = StructuredOutput.json_schema(SCHEMAS[0], whitespace="compact")


@pytest.mark.parametrize("forced", [True, False])
def test_leading_forced_tokens_are_prefilled_with_the_prompt(
    make_llm: Callable[..., Any], forced: bool
) -> None:
    llm = make_llm(forced_tokens=forced, enable_prefix_caching=False)
    calls = _record_forwards(llm)
    tok = llm.engine.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True)
    prompt = tok.encode(chat, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=48, structured=COMPACT_CITY)
    out = llm.generate([prompt], params)[0]
    leading = GrammarMatcher(llm.engine.grammar.compile(COMPACT_CITY.to_grammar())).forced_tokens()
    assert leading, "the compact grammar fixes no leading tokens: the test checks nothing"
    assert out.text.startswith(tok.decode(leading))
    if forced:  # forced off, the model may spell the same text with other tokens
        assert out.token_ids[: len(leading)] == leading
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), SCHEMAS[0])
    # Forced on: the first forward pass is the prompt plus the leading forced tokens; every pass
    # samples one token, so forced runs (each fed as one chunk) cost no pass of their own, nor do
    # accepted boundary drafts (the forced text's last tokens, verified in the same pass).
    assert calls[0] == [len(prompt) + (len(leading) if forced else 0)]
    saved = out.metrics.num_forced_tokens + out.metrics.num_accepted_draft_tokens
    assert len(calls) == len(out.token_ids) - saved
    assert (out.metrics.num_forced_tokens > 0) == forced


def test_output_fixed_by_the_grammar_needs_no_forward_pass(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(forced_tokens=True)
    calls = _record_forwards(llm)
    outs = llm.generate(
        ["Say it:", "Say it again:"],
        [
            SamplingParams(temperature=0, max_tokens=16, structured=["the-only-choice"]),
            SamplingParams(temperature=0, max_tokens=2, structured=["the-only-choice"]),
        ],
    )
    assert outs[0].finish_reason == "stop" and outs[0].text == "the-only-choice"
    assert outs[0].outputs[0].token_ids[-1] in llm.engine.eos_token_ids
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 2
    assert "the-only-choice".startswith(outs[1].text)
    assert calls == []
