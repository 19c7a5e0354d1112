"""Grammar core: loop-region walks from the content check (``compute_region_content``).

A loop region (a string's content under a pattern or format) on which every string of up to 16
JSON string-content characters stays inside takes every content token as accepted and walks only
the other tokens. Where a few characters die or leave the region (a pattern's '.', U+2028 under
an ECMAScript '.', a letter that ends a literal), the content tokens with such a character are
walked too. Both must give exactly the full region walk's classification (accepted tokens,
uncertain positions, exit runs), and the masks must agree with ``accept_token`` token by token.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from test_grammar_core_support import assert_mask_exact, fresh_tokenizer_info, hf_tokenizer, mask_bits

from agent_infer.grammar.compiler import GrammarCompiler
from agent_infer.grammar.ir import Grammar
from agent_infer.grammar.matcher import GrammarMatcher

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


def _compile(tokenizer: str, schema: Any) -> Any:
    info = fresh_tokenizer_info(tokenizer)
    return info, GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(schema, whitespace="compact")
    )


@pytest.mark.parametrize("tokenizer", ["smollm2", "deepseek"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_region_content_walk_equals_the_full_region_walk(tokenizer: str, case: int) -> None:
    _, compiled = _compile(tokenizer, CASES[case][0])
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
    info, compiled = _compile(tokenizer, schema)
    tok = hf_tokenizer(tokenizer)
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
    # One token per character: the matcher meets every state of the string's loop.
    ids = [t for ch in text for t in tok.encode(ch, add_special_tokens=False).ids]
    m = GrammarMatcher(compiled)
    checked = 0
    for pos, tid in enumerate(ids):
        if pos % stride == 1:
            assert_mask_exact(m, pos)
            checked += 1
        else:
            mask_bits(m, info.vocab_size)  # the first visits happen in decoding order either way
        assert m.accept_token(tid), pos
    assert m.can_terminate()
    assert checked >= 2
