"""Grammar compiler: every constraint lowers to one IR (:mod:`.ir`), then to per-step token bitmasks.

Public names follow XGrammar's: Grammar, TokenizerInfo, GrammarCompiler, CompiledGrammar,
GrammarMatcher, allocate_token_bitmask, apply_token_bitmask_inplace.

The stages live in sub-packages, each importing only the ones before it: ``ir`` (the IR),
``frontends`` (regex, EBNF, JSON Schema to IR), ``automata`` (code-point DFAs the JSON Schema front
end builds with), ``compile`` (IR + tokenizer to native automata), ``runtime`` (matching and token
bitmasks). Importing this package registers the front ends with the IR (see
:mod:`.frontends`) and gives IR validation the native reference walk.
"""

from __future__ import annotations

import importlib
from typing import Any

from agent_infer.grammar import frontends as frontends
from agent_infer.grammar.ir import Grammar
from agent_infer.grammar.ir.references import use_native_walk
from agent_infer.native import optional_native

use_native_walk(lambda: optional_native("first_missing_ref"))

_LAZY = {
    "TokenizerInfo": "agent_infer.grammar.compile.tokenizer_info",
    "GrammarCompiler": "agent_infer.grammar.compile.compiler",
    "CompiledGrammar": "agent_infer.grammar.compile.compiler",
    "GrammarMatcher": "agent_infer.grammar.runtime.matcher",
    "BatchGrammarMatcher": "agent_infer.grammar.runtime.matcher",
    "allocate_token_bitmask": "agent_infer.grammar.runtime.bitmask",
    "apply_token_bitmask_inplace": "agent_infer.grammar.runtime.bitmask",
    "fill_next_token_bitmask_batch": "agent_infer.grammar.runtime.matcher",
    "clear_grammar_caches": "agent_infer.grammar.compile.caches",
}

__all__ = ["Grammar", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agent_infer.grammar' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
