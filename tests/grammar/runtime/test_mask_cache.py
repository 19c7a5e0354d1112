"""Grammar core: masks stay exact through the shared caches of the mask computation.

Loop regions (string contents) are walked once per tokenizer and string syntax and shared by
every string state; large run-time uncertain checks are memoized per parse context. Both are
checked here against ``accept_token`` on forks, for every token id, on a first pass (caches
filling) and a second pass over the same compiled grammar (caches hit).
"""

from __future__ import annotations

import json

from grammar_support import assert_mask_exact, hf_tokenizer, tokenizer_info

from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.ir import Grammar
from agent_infer.grammar.runtime.matcher import GrammarMatcher

# Two string properties with the same syntax (one shared region walk) and a maxLength string too
# long for 256-character chunks, which the front end splits into finite power-of-two rules whose
# ends make most tokens uncertain mid-string (the memoized run-time check).
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "city": {"type": "string", "maxLength": 100000},
        "note": {"type": "string"},
    },
    "required": ["name", "city", "note"],
    "additionalProperties": False,
}
DOC = {"name": 'Ada "the" Lovelace', "city": "Saint-Rémy-de-Provence, Bouches", "note": "ok"}


def _check_pass(compiled: object, ids: list[int], positions: set[int]) -> int:
    """Checks the mask at ``positions``; returns the largest uncertain set met on the way."""
    m = GrammarMatcher(compiled)  # type: ignore[arg-type]
    most_uncertain = 0
    for pos, tid in enumerate(ids):
        # (state, rule, origin, accepted, uncertain) per scanning item of the current set.
        items = m._m.debug_items()
        most_uncertain = max([most_uncertain, *(int(it[4]) for it in items)])
        if pos in positions:
            assert_mask_exact(m, pos)
        assert m.accept_token(tid), pos
    return most_uncertain


def test_shared_region_and_memoized_checks_exact() -> None:
    info = tokenizer_info("deepseek")
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(SCHEMA, whitespace="compact")
    )
    text = json.dumps(DOC, ensure_ascii=False, separators=(",", ":"))
    ids = hf_tokenizer("deepseek").encode(text, add_special_tokens=False).ids
    positions = set(range(1, len(ids), 2))
    # The memoized check only runs for large uncertain sets: make sure this case has them.
    assert _check_pass(compiled, ids, positions) >= 1024
    _check_pass(compiled, ids, positions)  # the memoized outcomes and cached regions now hit


# Additional keys must avoid the declared names: every prefix of a declared name is its own
# dense key state, assembled from first-byte pieces shared with the other key automaton below.
# The maxLength string's positions share pieces for short tokens; long runs of spaces and
# dashes are walked per position.
OPEN_SCHEMA = {
    "type": "object",
    "properties": {
        "outer": {
            "type": "object",
            "properties": {"name": {"type": "string"}, "nameless": {"type": "boolean"}},
            "additionalProperties": {"type": "integer"},
        },
        "city": {"type": "string", "maxLength": 30},
    },
    "additionalProperties": {"type": "integer"},
}
OPEN_DOC = {
    "outer": {"name": "x", "nam": 1, "namelessly": 2, "n\u00e9": 3, 'q"\\': 4},
    "city": "a-      --- b",
    "cit": 5,
    "city2": 6,
}


def test_first_byte_pieces_exact() -> None:
    info = tokenizer_info("deepseek")
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(OPEN_SCHEMA, whitespace="compact")
    )
    text = json.dumps(OPEN_DOC, ensure_ascii=False, separators=(",", ":"))
    # Byte-level steps put the matcher on every prefix state of the key automata.
    tok = hf_tokenizer("deepseek")
    ids = [t for ch in text for t in tok.encode(ch, add_special_tokens=False).ids]
    _check_pass(compiled, ids, set(range(0, len(ids), 4)))
    _check_pass(compiled, ids, set(range(1, len(ids), 7)))  # pieces and state masks now cached


# Short rules called from several places (`pair` stays a rule: it is recursive) make every longer
# token uncertain; the run-time
# check walks them as a pushdown automaton over the Earley context, which must agree with the
# Earley steps, also through left recursion (`list`), nullable rules (`opt`) and calls inside
# the token.
CHECK_GBNF = r"""
root ::= "<" pair pair opt pair ">" | "{" list "}"
list ::= list "," pair | pair
pair ::= ch ch | "(" pair ")"
opt ::= ch | ""
ch ::= [a-zA-Z0-9 ] | "-"
"""


def test_pushdown_check_matches_earley() -> None:
    info = tokenizer_info("deepseek")
    compiled = GrammarCompiler(info, cache_enabled=False).compile(Grammar.from_ebnf(CHECK_GBNF))
    tok = hf_tokenizer("deepseek")
    for text in ("<ab cd-e>", "{ab,c-,(de),f ,gh}"):
        ids = [t for ch in text for t in tok.encode(ch, add_special_tokens=False).ids]
        assert _check_pass(compiled, ids, set(range(len(ids)))) >= 128
