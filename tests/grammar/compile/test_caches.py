"""clear_grammar_caches: every cross-grammar memo is emptied, and compiling afterwards still works."""

from __future__ import annotations

import json

from agent_infer.grammar import (
    GrammarCompiler,
    GrammarMatcher,
    TokenizerInfo,
    clear_grammar_caches,
)
from agent_infer.grammar.frontends.json_schema.keys import complement_keys as json_schema_keys
from agent_infer.grammar.frontends.regex import search as regex
from agent_infer.native import load_native

SCHEMA = {
    "type": "object",
    # "a/b" is not plain ASCII, so the key trie is built node by node (in the memos under test).
    "properties": {"name": {"type": "string", "pattern": "^[a-z]+$"}, "age": {"type": "integer"}, "a/b": {}},
    "additionalProperties": {"type": "string", "format": "date"},
}


def _key_nodes() -> int:
    return len(json_schema_keys._TRIES) + int(load_native().key_trie_nodes())


def _accepts(compiler: GrammarCompiler, doc: object) -> bool:
    m = GrammarMatcher(compiler.compile_json_schema(SCHEMA, whitespace="compact"))
    return m.accept_string(json.dumps(doc, separators=(",", ":"))) and m.can_terminate()


def test_clear_empties_the_memos_and_compiles_the_same_language() -> None:
    compiler = GrammarCompiler(TokenizerInfo.bytes_only(), cache_enabled=False)
    good = {"name": "ada", "age": 36, "born": "1815-12-10"}
    bad = {"name": "Ada", "other": "x"}
    assert _accepts(compiler, good) and not _accepts(compiler, bad)
    # Key tries live in the native node table when the extension has it, else in _TRIES.
    assert _key_nodes() > 0 and regex.regex_search_expr.cache_info().currsize > 0
    clear_grammar_caches()
    assert not json_schema_keys._TRIES and not json_schema_keys._NODES and _key_nodes() == 0
    assert regex.regex_search_expr.cache_info().currsize == 0
    assert _accepts(compiler, good) and not _accepts(compiler, bad)
    clear_grammar_caches()  # twice in a row is fine
    assert _accepts(compiler, good)
