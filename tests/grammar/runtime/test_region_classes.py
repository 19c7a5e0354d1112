"""Grammar core: loop-region walks from byte classes (``region_from_classes``).

A class region (``[a-z]+``, ``\\w+``, a hex or identifier pattern) fails the content check, so a
plain walk would visit every token that starts inside it, and at depth 1 (first-byte pieces) every
token. Most tokens are decided by the byte groups they hold: all staying inside from every row means
accepted, a byte dead in every row and none that may leave means rejected. Only the rest is
walked. The result must be exactly the full region walk's (accepted tokens, uncertain positions,
exit runs, in walk order) at both depths, and masks must agree with ``accept_token``.
"""

from __future__ import annotations

from typing import Any

import pytest
from grammar_support import compile_schema_fresh, decode_char_by_char_exact

CASES: list[tuple[Any, Any]] = [
    ({"type": "string", "pattern": "^[a-z]+$"}, "lowercase"),
    ({"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"}, "snake_Case9"),
    ({"type": "string", "pattern": "^[0-9a-f]+(-[0-9a-f]+)*$"}, "0af3-9b"),
    # Rows that alternate: nothing stays in every row, but most bytes are dead in every row.
    ({"type": "string", "pattern": "^([a-z][0-9])+$"}, "a1b2c3"),
    # A URL path: the two rows after '%' accept hex digits only; the stay bytes are those of the
    # rows a walk keeps to without a '%'.
    ({"type": "string", "pattern": "^/(([a-zA-Z0-9._~-]|%[0-9a-fA-F]{2})+/?)*$"}, "/docs/a%20b/index.html"),
    # A negated class: its non-ASCII characters stay as whole UTF-8 sequences.
    ({"type": "string", "pattern": "^[^A-Z_ ]+$"}, "déjà-vu,日本語"),
    (
        {
            "type": "object",
            "properties": {
                "id": {"type": "string", "pattern": "^\\w+$"},
                "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z ]+$"}},
            },
            "required": ["id", "tags"],
            "additionalProperties": False,
        },
        {"id": "user_42", "tags": ["red fox", "blue"]},
    ),
]

ALTERNATING = 3


@pytest.mark.parametrize("tokenizer", ["smollm2", "deepseek"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_region_classes_walk_equals_the_full_region_walk(tokenizer: str, case: int) -> None:
    compiled = compile_schema_fresh(tokenizer, CASES[case][0])
    native = compiled._native
    for first in (0, 1):
        verdicts = [native.region_classes_matches_walk(s, first) for s in range(native.num_states)]
        assert 0 not in verdicts, (first, [s for s, v in enumerate(verdicts) if v == 0])
        # Where no byte stays in every row, most tokens hold letters that neither stay nor die
        # everywhere: at depth 1 (every token walked) the shortcut declines and the walk is kept.
        if first == 0 or case != ALTERNATING:
            assert verdicts.count(1) > 0, first


def test_region_classes_hook_checks_its_arguments() -> None:
    compiled = compile_schema_fresh("smollm2", CASES[0][0])
    with pytest.raises(ValueError, match="first must be 0 or 1"):
        compiled._native.region_classes_matches_walk(0, 2)
    with pytest.raises(IndexError, match="outside the grammar"):
        compiled._native.region_classes_matches_walk(compiled._native.num_states, 0)


@pytest.mark.parametrize(("tokenizer", "stride"), [("smollm2", 2), ("deepseek", 3)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_region_classes_masks_exact(tokenizer: str, stride: int, case: int) -> None:
    schema, doc = CASES[case]
    compiled = compile_schema_fresh(tokenizer, schema)
    decode_char_by_char_exact(compiled, tokenizer, doc, stride)
