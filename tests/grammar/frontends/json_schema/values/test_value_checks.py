"""Enum values checked against a bare ``{"type": ...}`` without building its grammar: the answer
must be exactly what running that grammar on the value gives."""

from __future__ import annotations

import pytest

from agent_infer.grammar.frontends.json_schema.compiler import Compiler
from agent_infer.grammar.frontends.json_schema.resolve.registry import build_registry
from agent_infer.grammar.frontends.json_schema.values.validation import answer_by_type

TYPES = [
    "null",
    "boolean",
    "integer",
    "number",
    "string",
    "object",
    "array",
    ["integer", "string"],
    ["number"],
    [],
]


VALUES = [
    None,
    True,
    False,
    0,
    -7,
    2**70,
    1.0,
    -0.0,
    1.5e-7,
    1e300,
    float("inf"),
    float("nan"),
    "",
    'a"\\\n\x01é\ud800',
]


@pytest.mark.parametrize("t", TYPES, ids=str)
def test_type_only_enum_check_agrees_with_the_grammar(t: object) -> None:
    """The shortcut decides exactly what running the ``{"type": t}`` grammar on the value decides."""
    registry, _ = build_registry({}, None)
    c = Compiler(registry, strict=True, whitespace="compact", max_whitespace=0, indent=None)
    for v in VALUES:
        rest = {"type": t}
        quick = answer_by_type(rest, v)
        assert quick is not None
        assert quick == c.value_matcher(rest, "", strict=True)(v), (t, v)
    assert answer_by_type({"type": "string", "maxLength": 2}, "abc") is None
    assert answer_by_type({"type": "strin"}, "abc") is None
    assert answer_by_type({"type": "string"}, ["a"]) is None
