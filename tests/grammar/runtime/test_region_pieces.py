"""Grammar core: masks stay exact through region pieces and the refined pushdown walk.

An unanchored ``pattern`` becomes a search automaton inside the string: every state of it lies
on one loop (a mismatch goes back to "nothing matched yet"), so each roots a loop region of its
own, assembled from cached first-byte pieces of its neighbours. A short ``maxLength`` string
followed by more properties makes its positions dense states whose rule calls other rules within
a token's reach: their pushdown walk runs only on the plain walk's uncertain tokens. Both are
checked against ``accept_token`` on forks, for every token id, with cold caches and again with
the pieces cached (a second grammar with the same pattern reuses them).
"""

from __future__ import annotations

import json

from grammar_support import assert_mask_exact, hf_tokenizer, tokenizer_info

from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.ir import Grammar
from agent_infer.grammar.runtime.matcher import GrammarMatcher

PATTERN = r"\d{4}-\d{2}(:\d{2})?"
SCHEMA = {
    "type": "object",
    "properties": {
        "stamp": {"type": "string", "pattern": PATTERN},
        "code": {"type": "string", "maxLength": 5},
        "word": {"type": "string", "pattern": r"^[a-z]+:\w+$"},
    },
    "required": ["stamp", "code", "word"],
    "additionalProperties": False,
}
DOC = {"stamp": "at 12 1999-1 2024-06:3x", "code": "a\u00e9 z", "word": "brn:x_1"}


def _exhaustive(compiled: object, ids: list[int], positions: set[int]) -> int:
    """Checks every token id's mask bit at ``positions``; returns how many positions it checked."""
    m = GrammarMatcher(compiled)  # type: ignore[arg-type]
    checked = 0
    for pos, tid in enumerate(ids):
        if pos in positions:
            assert_mask_exact(m, pos)
            checked += 1
        assert m.accept_token(tid), pos
    return checked


def _byte_level_ids(text: str) -> list[int]:
    """One token per character, so the matcher stops on every state of the string automata."""
    tok = hf_tokenizer("deepseek")
    return [t for ch in text for t in tok.encode(ch, add_special_tokens=False).ids]


def test_search_pattern_region_pieces_exact() -> None:
    info = tokenizer_info("deepseek")
    text = json.dumps(DOC, ensure_ascii=False, separators=(",", ":"))
    ids = _byte_level_ids(text)
    stamp_end = text.index('","code"')
    # Every state of the search automaton and of the bounded string, then the word pattern.
    first = set(range(10, stamp_end + 2)) | set(range(len(ids) - 24, len(ids), 3))
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(SCHEMA, whitespace="compact")
    )
    assert _exhaustive(compiled, ids, first) == len(first)
    # A second grammar with the same pattern: its region states now come from cached pieces.
    other = dict(SCHEMA, properties={**SCHEMA["properties"], "extra": {"type": "integer"}})
    compiled2 = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(other, whitespace="compact")
    )
    assert _exhaustive(compiled2, ids, set(range(11, stamp_end + 2, 2))) > 0


def test_dense_bounded_string_with_calls_exact() -> None:
    info = tokenizer_info("deepseek")
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(SCHEMA, whitespace="compact")
    )
    text = json.dumps(DOC, ensure_ascii=False, separators=(",", ":"))
    ids = hf_tokenizer("deepseek").encode(text, add_special_tokens=False).ids
    assert _exhaustive(compiled, ids, set(range(len(ids)))) == len(ids)


# Up to 20 letters, "=" and a quoted value: each letter position is a dense state of a chain too
# long for first-byte pieces, unique near the chain's end (no short-token mask), whose rule calls
# `value` within a token's reach: tokens such as '="' are uncertain for the plain walk and
# resolved by the pushdown walk (entering `value`; its loop keeps it a rule of its own).
REFINE_GBNF = r"""
root ::= [a-z]{1,20} "=" value ";" "abcdefghijklmnopqrstuvwxyz0123456789abcdefghijklmnopqrstuvwxyz"
value ::= "\"" [a-z#]* "\""
"""


def test_refined_pushdown_walk_exact() -> None:
    info = tokenizer_info("deepseek")
    compiled = GrammarCompiler(info, cache_enabled=False).compile(Grammar.from_ebnf(REFINE_GBNF))
    ids = _byte_level_ids('abcdefghijklmnopqr="#ab";abc')
    assert _exhaustive(compiled, ids, set(range(len(ids)))) == len(ids)
