"""Grammar core: loop-region walks from the content check (``compute_region_content``).

A loop region (a string's content under a pattern or format) on which every string of up to 16
JSON string-content characters stays inside takes every content token as accepted and walks only
the other tokens. Where a few characters die or leave the region (a pattern's '.', U+2028 under
an ECMAScript '.', a letter that ends a literal), the content tokens with such a character are
walked too. Both must give exactly the full region walk's classification (accepted tokens,
uncertain positions, exit runs), and the masks must agree with ``accept_token`` token by token.
"""

from __future__ import annotations

from typing import Any

import pytest
from grammar_support import compile_schema_fresh, decode_char_by_char_exact

# Patterns are unanchored unless they say so: most lower to a `.*` loop around a literal.
CASES: list[tuple[Any, Any]] = [
    ({"type": "string", "pattern": "^allow|deny$"}, "so we deny"),
    ({"type": "string", "pattern": "\\.json$"}, "a.b.json"),
    ({"type": "string", "pattern": "^.*x.*$"}, "max value"),
    (
        {
            "type": "object",
            "properties": {
                "p": {"type": "string", "pattern": "null"},
                "q": {"type": "string", "pattern": "^[^@]+@"},
            },
            "required": ["p", "q"],
            "additionalProperties": False,
        },
        {"p": "is null here", "q": "me@home"},
    ),
]


@pytest.mark.parametrize("tokenizer", ["smollm2", "deepseek"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_region_content_walk_equals_the_full_region_walk(tokenizer: str, case: int) -> None:
    compiled = compile_schema_fresh(tokenizer, CASES[case][0])
    native = compiled._native
    # Depth 1: the region entered with each token's first byte taken as read (first-byte pieces).
    for first in (0, 1):
        verdicts = [native.region_content_matches_walk(s, first) for s in range(native.num_states)]
        assert 0 not in verdicts, (first, [s for s, v in enumerate(verdicts) if v == 0])
        assert verdicts.count(1) > 0, first  # the shortcut applies somewhere in each of these strings


@pytest.mark.parametrize(("tokenizer", "stride"), [("smollm2", 2), ("deepseek", 4)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_region_content_masks_exact(tokenizer: str, stride: int, case: int) -> None:
    schema, doc = CASES[case]
    compiled = compile_schema_fresh(tokenizer, schema)
    decode_char_by_char_exact(compiled, tokenizer, doc, stride)
