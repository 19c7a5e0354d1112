"""``contains`` with ``minContains``/``maxContains`` and item counts (types/arrays.py): hits and
misses read by one rule per count seen so far, the misses lowered as ``items`` and ``not contains``
(a complement, or a check where none can be written), against jsonschema on candidate arrays,
with exact masks on a real vocabulary.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from grammar_support import assert_mask_exact, hf_tokenizer, tokenizer_info

from agent_infer.errors import UnsupportedSchemaError
from agent_infer.grammar import Grammar, GrammarCompiler, GrammarMatcher, TokenizerInfo
from agent_infer.grammar.ir import Check

COUNTED: list[Any] = [
    {"contains": {"const": 1}, "maxContains": 1},
    {"contains": {"const": 1}, "minContains": 2},
    {"contains": {"const": 1}, "minContains": 0, "maxContains": 0},
    {"contains": {"const": 1}, "minContains": 0, "maxContains": 2},
    {"contains": {"const": 1}, "minContains": 2, "maxContains": 3},
    {"contains": {"const": 1}, "minContains": 3, "maxContains": 1},
    {
        "type": "array",
        "items": {"type": "integer"},
        "contains": {"minimum": 3},
        "minContains": 2,
        "minItems": 2,
    },
    {"contains": {"const": 1}, "minItems": 3},
    {"contains": {"const": 1}, "maxItems": 2, "minContains": 0, "maxContains": 1},
    {"contains": {"const": 1}, "minContains": 2, "minItems": 3, "maxItems": 4},
    # A complement no keyword writes (multipleOf): the misses are a `not` check.
    {"type": "array", "items": {"type": "integer"}, "contains": {"multipleOf": 3}, "maxContains": 1},
]

CANDIDATES: list[Any] = [
    *([], [1], [2], [1, 1], [1, 2], [2, 1], [2, 1, 2], [1, 1, 1], [1, 2, 1, 1], [1, 1, 1, 1]),
    *([3], [3, 4], [3, 3], [2, 3, 4, 5], [6, 9], [6, 7], [1, 6, 7, 9], [0], ["x", 1], [1.5, 1]),
    *("x", 3, None, {"a": 1}),
]


def _accepts(compiled: Any, text: str) -> bool:
    m = GrammarMatcher(compiled)
    return m.accept_string(text) and m.can_terminate()


@pytest.fixture(scope="module")
def byte_compiler() -> GrammarCompiler:
    return GrammarCompiler(TokenizerInfo.bytes_only(), cache_enabled=False)


@pytest.mark.parametrize("schema", COUNTED, ids=lambda s: json.dumps(s)[:70])
@pytest.mark.parametrize("whitespace", ["compact", "flexible"])
def test_counts_agree_with_jsonschema(schema: Any, whitespace: str, byte_compiler: GrammarCompiler) -> None:
    compiled = byte_compiler.compile(Grammar.from_json_schema(schema, whitespace=whitespace))
    oracle = jsonschema.Draft202012Validator(schema)
    wrong = []
    for inst in CANDIDATES:
        text = (
            json.dumps(inst, separators=(",", ":")) if whitespace == "compact" else json.dumps(inst, indent=2)
        )
        if _accepts(compiled, text) != oracle.is_valid(inst):
            wrong.append(text)
    assert not wrong, wrong


def test_a_complement_no_keyword_writes_is_a_check() -> None:
    grammar = Grammar.from_json_schema(COUNTED[-1])
    assert any(isinstance(body, Check) for _, body in grammar.rules)


@pytest.mark.parametrize(("schema", "doc"), [(COUNTED[4], [1, 2, 1, 1]), (COUNTED[-1], [1, 3, 4, 6])])
def test_masks_exact_on_a_real_vocabulary(schema: Any, doc: Any) -> None:
    compiled = GrammarCompiler(tokenizer_info("deepseek")).compile(
        Grammar.from_json_schema(schema, whitespace="compact")
    )
    ids = (
        hf_tokenizer("deepseek").encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False).ids
    )
    m = GrammarMatcher(compiled)
    for pos, tid in enumerate(ids):
        assert_mask_exact(m, pos)
        if not m.accept_token(tid):
            break  # the doc runs past the count: the mask before this token already said so
    assert_mask_exact(m, len(ids))


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        ({"type": "array", "prefixItems": [{}], "contains": {"const": 1}, "minContains": 2}, "prefixItems"),
        ({"type": "array", "contains": {"const": 1}, "minContains": 100, "maxItems": 100}, "counting states"),
    ],
)
def test_counts_past_what_is_built_stay_refused(schema: Any, why: str) -> None:
    with pytest.raises(UnsupportedSchemaError, match=why) as info:
        Grammar.from_json_schema(schema)
    assert info.value.pointer == "/contains"


def test_non_strict_drops_counts_past_the_limit_with_a_warning(byte_compiler: GrammarCompiler) -> None:
    schema = {"type": "array", "contains": {"const": 1}, "minContains": 100, "maxItems": 100}
    grammar = Grammar.from_json_schema(schema, strict=False, whitespace="compact")
    assert any("counting states" in w and "/contains" in w for w in grammar.warnings)
    assert _accepts(byte_compiler.compile(grammar), "[2,3]")
