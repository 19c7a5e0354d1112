"""The engine's GrammarManager: the lowering cache, compiles in the worker pool while a request waits
(WAITING_FOR_GRAMMAR), and the mask fill overlapped with the forward pass."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
from engine_support import drain as _drain
from pydantic import BaseModel

from agent_infer import SamplingParams
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.grammar_manager import GrammarManager
from agent_infer.engine.sequence import SequenceStatus
from agent_infer.errors import ConfigError, InvalidRequestError, UnsupportedSchemaError
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer
from agent_infer.structured import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "rank": {"type": "integer", "minimum": 1}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}
# Lowers fine (a well-formed grammar) but its language is empty: the compile, not the front end, fails.
EMPTY_LANGUAGE = StructuredOutput.ebnf('root ::= a\na ::= a "x"\n')
ARITHMETIC = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]{1,3}\n'


def test_config_options_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_INFER_ASYNC_SCHEDULING", "0")
    assert EngineConfig().use_async_scheduling is False
    assert EngineConfig(async_scheduling=True).use_async_scheduling is True
    monkeypatch.setenv("AGENT_INFER_ASYNC_SCHEDULING", "1")
    assert EngineConfig().use_async_scheduling is True
    assert EngineConfig(async_scheduling=False).use_async_scheduling is False
    with pytest.raises(ConfigError, match="grammar_workers"):
        EngineConfig(grammar_workers=0)
    with pytest.raises(ConfigError, match="forced_tokens"):
        EngineConfig.from_kwargs(forced_tokens="yes")


def test_lowering_error_raises_at_once_with_cause(llm: Any) -> None:
    bad = {"type": "object", "properties": {"a": {"type": "string", "format": "idn-email"}}}
    with pytest.raises(InvalidRequestError) as info:
        llm.engine.add_request("lower-fails", "x", SamplingParams(structured=bad))
    assert info.value.field == "structured"
    cause = info.value.__cause__
    assert isinstance(cause, UnsupportedSchemaError)
    assert cause.keyword == "format" and cause.pointer == "/properties/a/format"
    assert "lower-fails" not in llm.engine.requests


def test_request_waits_for_grammar_then_runs(make_llm: Callable[..., Any]) -> None:
    engine = make_llm().engine
    # A schema no other test uses, so the compile cannot be a cache hit.
    schema = {"type": "object", "properties": {"waits": {"type": "boolean"}}, "required": ["waits"]}
    engine.add_request("w", "JSON:", SamplingParams(temperature=0, max_tokens=32, structured=schema))
    seq = engine.requests["w"]
    assert seq.status is SequenceStatus.WAITING_FOR_GRAMMAR and seq.matcher is None
    assert seq.grammar_future is not None
    done = _drain(engine)
    assert done["w"].finish_reason == "stop"
    assert json.loads(done["w"].text)["waits"] in (True, False)


def test_failed_compile_fails_alone_in_mixed_batch(make_llm: Callable[..., Any]) -> None:
    engine = make_llm().engine
    engine.add_request("free", "Once upon a time", SamplingParams(temperature=0, max_tokens=8))
    engine.add_request("json", "JSON:", SamplingParams(temperature=0, max_tokens=64, structured=SCHEMA))
    engine.add_request("empty", "x", SamplingParams(max_tokens=8, structured=EMPTY_LANGUAGE))
    engine.add_request("free2", "The sky is", SamplingParams(temperature=0.7, seed=1, max_tokens=8))
    done = _drain(engine)
    assert set(done) == {"free", "json", "empty", "free2"}
    assert done["empty"].finish_reason == "error"
    assert "GrammarDefinitionError" in (done["empty"].outputs[0].error or "")
    assert done["empty"].token_ids == []
    assert done["free"].finish_reason == "length" and done["free2"].finish_reason == "length"
    assert done["json"].finish_reason == "stop"
    jsonschema.validate(json.loads(done["json"].text), SCHEMA)


def test_abort_while_waiting_for_grammar(make_llm: Callable[..., Any]) -> None:
    engine = make_llm().engine
    schema = {"type": "object", "properties": {"aborted": {"type": "integer"}}}
    engine.add_request("a", "JSON:", SamplingParams(max_tokens=8, structured=schema))
    engine.abort("a")
    done = _drain(engine)
    assert done["a"].finish_reason == "abort"
    assert not engine.scheduler.waiting_for_grammar


def _mixed_batch(llm: Any) -> list[Any]:
    prompts = [
        [{"role": "user", "content": "Name a big city and its rank as JSON."}],
        [{"role": "user", "content": "Tell me a short story."}],
        [{"role": "user", "content": "Write a sum."}],
        [{"role": "user", "content": "Return JSON about Tokyo."}],
        [{"role": "user", "content": "Say hello."}],
    ]
    params = [
        SamplingParams(temperature=0, max_tokens=64, structured=SCHEMA),
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0, max_tokens=24, structured=StructuredOutput.ebnf(ARITHMETIC)),
        SamplingParams(temperature=0.9, seed=4, max_tokens=64, structured=SCHEMA),
        SamplingParams(temperature=0.9, seed=4, max_tokens=24),
    ]
    return list(llm.chat(prompts, params))


@pytest.mark.parametrize("forced", [True, False])
def test_async_scheduling_on_and_off_identical(make_llm: Callable[..., Any], forced: bool) -> None:
    on = make_llm(async_scheduling=True, forced_tokens=forced)
    off = make_llm(async_scheduling=False, forced_tokens=forced)
    assert on.engine.grammar.filler.overlap and not off.engine.grammar.filler.overlap
    a, b = _mixed_batch(on), _mixed_batch(off)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert a[0].finish_reason == "stop"  # greedy: this prompt's answer is short
    jsonschema.validate(json.loads(a[0].text), SCHEMA)
    # Sampled at 0.9, the small model may spend its tokens on \uXXXX escapes inside "city" (up to
    # 20 characters of six bytes each), so it may hit the token limit: then the text is a prefix.
    if a[3].finish_reason == "stop":
        jsonschema.validate(json.loads(a[3].text), SCHEMA)
    else:
        assert a[3].finish_reason == "length"
        schema_language = ReferenceRecognizer(StructuredOutput.json_schema(SCHEMA).to_grammar())
        assert schema_language.is_prefix(a[3].text) and not schema_language.accepts(a[3].text)
    recognizer = ReferenceRecognizer(StructuredOutput.ebnf(ARITHMETIC).to_grammar())
    assert recognizer.accepts(a[2].text) if a[2].finish_reason == "stop" else recognizer.is_prefix(a[2].text)


class Point(BaseModel):
    x: int
    y: int


def test_lowering_is_cached_per_constraint(llm: Any) -> None:
    manager: GrammarManager = llm.engine.grammar
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    ba = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}
    first = manager.lower(StructuredOutput.json_schema(ab))
    assert manager.lower(StructuredOutput.json_schema(dict(ab))) is first
    other = manager.lower(StructuredOutput.json_schema(ba))
    assert other is not first and str(other) != str(first)  # property order is part of the grammar
    model = manager.lower(StructuredOutput.json_schema(Point))
    assert manager.lower(StructuredOutput.json_schema(Point)) is model
    regex = manager.lower(StructuredOutput.regex("[0-9]{3}"))
    assert manager.lower(StructuredOutput.regex("[0-9]{3}")) is regex
    assert manager.lower(StructuredOutput.regex("[0-9]{4}")) is not regex
