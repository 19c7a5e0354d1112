"""Grammar core: masks stay exact where the first-visit walks share or skip work.

The pushdown walk drops frames of calls in tail position and configurations that read no byte,
so the free branch of every node of a "key other than these names" trie reaches the same
configuration sets (and memoized transitions) from whichever node it starts; the walks skip
runs of sibling tokens that die, rejected, at one byte; walks of sparse states collect accepted
ids in a list instead of a vocabulary bitset. Each is checked against ``accept_token`` on forks,
for every token id, on documents that visit many trie nodes whose names share prefixes (free
keys next to declared ones) and objects of many optional properties (one sparse state each).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from grammar_support import assert_mask_exact, hf_tokenizer, tokenizer_info

from agent_infer.grammar.compile.compiler import GrammarCompiler
from agent_infer.grammar.ir import Grammar
from agent_infer.grammar.runtime.matcher import GrammarMatcher

# Declared names sharing prefixes (trie nodes with one or several continuing bytes) next to free
# keys; the nested object has many optional properties (one sparse key state per suffix).
NAMES = ["name", "namespace", "nameservers", "image", "imagePullPolicy", "images", "id", "idle", "labels"]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        **{n: {"type": "string"} for n in NAMES},
        "spec": {
            "type": "object",
            "properties": {f"p{k}_{w}": {"type": "integer"} for k, w in enumerate("abcdefghijklmnop")},
            "additionalProperties": False,
        },
    },
    "additionalProperties": {"type": "integer"},
}
# Declared properties come in declared order, free keys after them.
DOCS = [
    {"namespace": "a", "imagePullPolicy": "b", "idle": "c", "labels": "d", "nam": 1, "imag": 2, "idl": 3},
    {"name": "n", "nameservers": "y", "image": "x", "spec": {"p3_d": 1, "p9_j": 2}, "names": 1, "i": 4},
]


def _check(compiled: object, text: str, every: int) -> None:
    ids = hf_tokenizer("deepseek").encode(text, add_special_tokens=False).ids
    m = GrammarMatcher(compiled)  # type: ignore[arg-type]
    for pos, tid in enumerate(ids):
        if pos % every == 0 or pos == len(ids) - 1:
            assert_mask_exact(m, pos)
        assert m.accept_token(tid), (pos, text)


@pytest.mark.parametrize("doc", range(len(DOCS)))
def test_key_trie_and_sparse_states_exact(doc: int) -> None:
    info = tokenizer_info("deepseek")
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(SCHEMA, whitespace="compact")
    )
    # The other document first: this one's states then meet walks, sets and pieces it left.
    other = json.dumps(DOCS[1 - doc], separators=(",", ":"))
    GrammarMatcher(compiled).accept_string(other)
    _check(compiled, other, every=4)
    _check(compiled, json.dumps(DOCS[doc], separators=(",", ":")), every=2)
