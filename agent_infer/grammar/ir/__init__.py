"""The one grammar IR every front end lowers to (regex, JSON Schema, GBNF, Lark, choices).

A :class:`Grammar` is an ordered set of named rules, each an :class:`Expr` tree over Unicode
code points. The tree has twelve node kinds (:data:`NODE_KINDS`) and nothing else:

* :class:`Empty` -- the empty string.
* :class:`Literal` -- a fixed, non-empty string.
* :class:`CharClass` -- one code point from inclusive ranges (optionally negated).
* :class:`Seq` / :class:`Alt` -- concatenation / alternation.
* :class:`Repeat` -- ``item{min,max}`` (``max=None`` is unbounded).
* :class:`Ref` -- a reference to another rule (recursion, including left recursion, is allowed).
* :class:`KeySet` / :class:`KeyNode` -- "any JSON object key but these names" as a whole trie
  (one ``KEY_TRIE`` instruction) or one trie node, compiled from their compact source; their
  alternation (:meth:`KeySet.expand`) is built by the JSON Schema front end, on first use.
* :class:`UniqueItem` -- a rule body matching one item of a JSON array whose items must be
  distinct: the matcher rejects the item at its last byte when its value equals an earlier one.
* :class:`BoundedString` -- a rule body matching a JSON string of at most so many code points,
  counted by the matcher as the string is read.
* :class:`Check` -- a span the first of its rule references scan, kept only when the set of
  references whose language holds it is one of the accepted sets (``oneOf``, ``not``, ``allOf``
  decided by the matcher at the span's end); only a rule's whole body.

``str(grammar)`` prints GBNF (llama.cpp's dialect, plus ``_`` in names; key tries print as
``%key-set(...)`` / ``%key-node(...)``, unique items as ``%unique(...)``, bounded strings as ``%max-length(N ...)``), which our GBNF front end reads back to an equal grammar,
so a failing test can show what a schema lowered to.
The IR imports no other part of the package: front ends register their builders for
``Grammar.from_*`` (:func:`register_frontend`). The native compiler lowers the tree to UTF-8 byte
automata; see ``docs/grammar_engine.md``.
"""

# The IR lives in one module per concept (nodes, constructors, printing, the grammar); this module
# keeps the one import path every front end, test and user reads them from.
from agent_infer.grammar.ir.constructors import (
    alt,
    alt_disjoint,
    chars,
    lit,
    opt,
    plus,
    seq,
    star,
    walk,
)
from agent_infer.grammar.ir.grammar import (
    FRONTENDS,
    Grammar,
    builtin_grammar_path,
    grammars_dir,
    register_frontend,
)
from agent_infer.grammar.ir.grammar import _rename as _rename
from agent_infer.grammar.ir.nodes import (
    MAX_CHECK_ITEMS,
    MAX_CODEPOINT,
    NODE_KINDS,
    Alt,
    BoundedString,
    CharClass,
    Check,
    Empty,
    Expr,
    KeyNode,
    KeySet,
    Literal,
    Ref,
    Repeat,
    Seq,
    UniqueItem,
    complement_ranges,
    merge_ranges,
    register_expansion,
)

__all__ = [
    "FRONTENDS",
    "MAX_CHECK_ITEMS",
    "MAX_CODEPOINT",
    "NODE_KINDS",
    "Alt",
    "BoundedString",
    "CharClass",
    "Check",
    "Empty",
    "Expr",
    "Grammar",
    "KeyNode",
    "KeySet",
    "Literal",
    "Ref",
    "Repeat",
    "Seq",
    "UniqueItem",
    "alt",
    "alt_disjoint",
    "builtin_grammar_path",
    "chars",
    "complement_ranges",
    "grammars_dir",
    "lit",
    "merge_ranges",
    "opt",
    "plus",
    "register_expansion",
    "register_frontend",
    "seq",
    "star",
    "walk",
]
