"""The process-wide memos of the grammar front ends, and one switch that empties them all.

Compiling a schema reuses work from earlier grammars in the same process: key tries by name set,
pattern and format automata, the serialized programs of shared rule bodies. A server gains from
that; a benchmark of cold compiles must not, so :func:`clear_grammar_caches` drops every such memo
(each is also bounded on its own). Tables that depend only on the library (Unicode classes) or
on the tokenizer (``TokenizerInfo``) are not memos of earlier grammars and stay.
"""

from __future__ import annotations

from agent_infer.grammar.common.memo import clear_registered, register_clearer
from agent_infer.grammar.ir.constructors import clear_literal_memo
from agent_infer.native import load_native

register_clearer(clear_literal_memo)


def clear_grammar_caches() -> None:
    """Forget everything the front ends and the serializer memoised from earlier grammars, so the
    next compile runs as in a fresh process (imports aside). Safe while other threads compile:
    a memo miss only recomputes."""
    clear_registered()
    native = load_native()
    if hasattr(native, "clear_body_cache"):
        native.clear_body_cache()
