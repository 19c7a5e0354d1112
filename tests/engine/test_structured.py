"""Grammar-constrained requests on the real default model: outputs parse, bad constraints fail alone."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Literal

import jsonschema
import pytest
from engine_support import drain as _drain
from pydantic import BaseModel

from agent_infer import SamplingParams
from agent_infer.errors import InvalidRequestError
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer
from agent_infer.structured import StructuredOutput


class Pet(BaseModel):
    name: str
    species: Literal["cat", "dog", "bird"]
    age: int


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "rank": {"type": "integer", "minimum": 1}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schema_outputs_validate(llm: Any, temperature: float) -> None:
    params = SamplingParams(temperature=temperature, seed=7, max_tokens=96, structured=SCHEMA)
    outs = llm.chat(
        [
            [{"role": "user", "content": "Name a big city and its rank as JSON."}],
            [{"role": "user", "content": "Return JSON about Tokyo."}],
        ],
        params,
    )
    for out in outs:
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        jsonschema.validate(value, SCHEMA)
        assert out.outputs[0].parsed == value


def test_pydantic_model_gives_instance(llm: Any) -> None:
    out = llm.chat(
        [{"role": "user", "content": "Describe a pet as JSON."}],
        SamplingParams(temperature=0, max_tokens=96, structured=Pet),
    )[0]
    assert out.finish_reason == "stop", out.text
    assert isinstance(out.outputs[0].parsed, Pet)


def test_regex_choice_and_ebnf(llm: Any) -> None:
    arithmetic = 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]{1,3}\n'
    params = [
        SamplingParams(
            temperature=0.8, seed=3, max_tokens=20, structured=StructuredOutput.regex(r"\d{3}-\d{4}")
        ),
        SamplingParams(temperature=0.8, seed=3, max_tokens=5, structured=["red", "green", "blue"]),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, structured=StructuredOutput.ebnf(arithmetic)),
    ]
    outs = llm.generate(["Call me at", "My favourite colour is", "Compute:"], params)
    import re

    assert outs[0].finish_reason == "stop" and re.fullmatch(r"\d{3}-\d{4}", outs[0].text)
    assert outs[1].finish_reason == "stop" and outs[1].text in ("red", "green", "blue")
    grammar = StructuredOutput.ebnf(arithmetic).to_grammar()
    text = outs[2].text
    recognizer = ReferenceRecognizer(grammar)
    assert recognizer.accepts(text) if outs[2].finish_reason == "stop" else recognizer.is_prefix(text)


def test_max_tokens_mid_object_reports_length(llm: Any) -> None:
    out = llm.generate("JSON:", SamplingParams(temperature=0, max_tokens=3, structured=SCHEMA))[0]
    assert out.finish_reason == "length"
    assert out.outputs[0].parsed is None
    assert ReferenceRecognizer(StructuredOutput.json_schema(SCHEMA).to_grammar()).is_prefix(out.text)


def test_mixed_batch_and_broken_schema_fails_alone(make_llm: Callable[..., Any]) -> None:
    engine = make_llm().engine
    engine.add_request("free", "Once upon a time", SamplingParams(temperature=0, max_tokens=8))
    engine.add_request("json", "JSON:", SamplingParams(temperature=0, max_tokens=64, structured=SCHEMA))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request("bad", "x", SamplingParams(structured={"type": "object", "minProperties": "two"}))
    assert info.value.field == "structured"
    done = _drain(engine)
    assert set(done) == {"free", "json"}
    assert done["free"].finish_reason == "length"
    assert done["json"].finish_reason == "stop"
    jsonschema.validate(json.loads(done["json"].text), SCHEMA)


def test_unrecognised_constraint_is_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="cannot tell what constraint"):
        SamplingParams(structured="[a-z]+")
