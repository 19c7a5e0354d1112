"""The engine's lowering cache: same constraint, same IR object; declared property order kept apart."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from agent_infer.engine.grammar_manager import GrammarManager
from agent_infer.structured import StructuredOutput


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
