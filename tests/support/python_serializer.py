"""The IR serializer written in Python: the test oracle for the native one
(``agent_infer.grammar.compile.serialize``), which must write exactly the same rule programs.

Every node kind is written as the native serializer writes it: a :class:`KeySet` rule body as one
``KEY_TRIE`` instruction, a :class:`KeyNode` (and a nested ``KeySet``) as the alternation it
expands to, whose words the native serializer writes from the node's spec, a :class:`UniqueItem`
rule body as the ``UNIQUE`` marker word followed by its item's program, a :class:`BoundedString`
as ``MAX_LENGTH n`` then its item's program, and a :class:`Check` rule body as one ``CHECK``
instruction.
"""

from __future__ import annotations

import itertools
from array import array

from agent_infer.errors import GrammarDefinitionError, GrammarLimitError
from agent_infer.grammar.ir import (
    Alt,
    BoundedString,
    CharClass,
    Check,
    Empty,
    Expr,
    Grammar,
    KeyNode,
    KeySet,
    Literal,
    Ref,
    Repeat,
    Seq,
    UniqueItem,
)

# Opcodes shared with engine_native/src/grammar/ir/program.h (enum Op).
(
    _EMPTY,
    _LITERAL,
    _CLASS,
    _SEQ,
    _ALT,
    _REPEAT,
    _REF,
    KEY_TRIE_OPCODE,
    UNIQUE_OPCODE,
    MAX_LENGTH_OPCODE,
    CHECK_OPCODE,
) = range(11)
_INT32_MAX = 2**31 - 1


def key_set_program(node: KeySet, index: dict[str, int]) -> list[int]:
    """The ``KEY_TRIE`` instruction (the whole rule program) of ``node``, given the rule index."""
    words = [index[KeySet.FREE_RULE], index[KeySet.REST_RULE], len(node.names)]
    for name in node.names:
        words.append(len(name))
        words.extend(map(ord, name))
    return [KEY_TRIE_OPCODE, len(words), *words]


def check_program(node: Check, index: dict[str, int]) -> list[int]:
    """The ``CHECK`` instruction (the whole rule program) of ``node``, given the rule index."""
    # The carriers word holds the product flag at bit 12 (grammar/ir/program.h).
    words = [
        len(node.items),
        node.carriers | (4096 if node.product else 0),
        len(node.accept),
        *node.accept,
        *(index[r.name] for r in node.items),
    ]
    return [CHECK_OPCODE, len(words), *words]


def program_bytes(programs: list[list[int]]) -> bytes:
    """Rule count, program lengths and words as int32 bytes: the layout of native ``SerializedRules``."""
    flat = array("i", [len(programs)])
    flat.extend(len(p) for p in programs)
    flat.extend(itertools.chain.from_iterable(programs))
    return flat.tobytes()


def _serialize_expr(expr: Expr, index: dict[str, int], out: list[int]) -> None:
    """Append the prefix encoding of ``expr`` (see grammar/ir/program.h) to ``out`` (iteratively, any depth)."""
    stack: list[Expr] = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, Literal | CharClass):
            out.extend(_leaf(node))
        elif isinstance(node, KeySet | KeyNode):
            items = node.expand()  # a key-trie node's program is that of its alternation
            out.append(_ALT)
            out.append(len(items))
            stack.extend(reversed(items))
        elif isinstance(node, Seq | Alt):
            out.append(_SEQ if isinstance(node, Seq) else _ALT)
            out.append(len(node.items))
            stack.extend(reversed(node.items))
        elif isinstance(node, Repeat):
            out.extend(_repeat_head(node))
            stack.append(node.item)
        elif isinstance(node, Ref):
            out.append(_REF)
            out.append(index[node.name])
        elif isinstance(node, Empty):
            out.append(_EMPTY)
        else:
            raise GrammarDefinitionError(f"not an IR node: {node!r}")


# Literal programs by text: keys, punctuation and keywords recur across rules and grammars.
_LITERAL_CHUNKS: dict[str, tuple[int, ...]] = {}
_MAX_LITERAL_CHUNKS = 1 << 16


def _leaf(node: Literal | CharClass) -> tuple[int, ...]:
    """The program of a Literal or CharClass node (literals cached by text)."""
    if isinstance(node, CharClass):
        ranges = node.normalized()
        return (_CLASS, len(ranges), *(x for pair in ranges for x in pair))
    text = node.text
    chunk = _LITERAL_CHUNKS.get(text)
    if chunk is None:
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            raise GrammarDefinitionError(
                f"literal {text!r} contains a lone surrogate, which has no UTF-8 encoding"
            ) from None
        chunk = (_LITERAL, len(data), *data)
        if len(_LITERAL_CHUNKS) >= _MAX_LITERAL_CHUNKS:
            _LITERAL_CHUNKS.clear()
        _LITERAL_CHUNKS[text] = chunk
    return chunk


def _repeat_head(node: Repeat) -> tuple[int, int, int]:
    if node.min > _INT32_MAX or (node.max is not None and node.max > _INT32_MAX):
        raise GrammarLimitError(f"repeat bounds {{{node.min},{node.max}}} are too large")
    return (_REPEAT, node.min, -1 if node.max is None else node.max)


class _Serializer:
    """Programs of one grammar's rules. A composite node met again (subtrees are shared within and
    between rules) copies the slice its first occurrence wrote instead of being walked again."""

    def __init__(self, index: dict[str, int]) -> None:
        self.index = index
        self.refs = {name: (_REF, i) for name, i in index.items()}
        self.programs: list[list[int]] = []
        # id(node) -> where its first occurrence was written, packed into one int as
        # rule << 64 | start << 32 | end: ints are not tracked by the cyclic GC, tuples would be.
        self.spans: dict[int, int] = {}
        self.rule = 0

    def emit(self, node: Expr, out: list[int]) -> None:
        kind = type(node)
        if kind is Literal or kind is CharClass:
            out.extend(_leaf(node))  # type: ignore[arg-type]
            return
        if kind is Ref:
            out.extend(self.refs[node.name])  # type: ignore[attr-defined]
            return
        if kind is Empty:
            out.append(_EMPTY)
            return
        span = self.spans.get(id(node))
        if span is not None:
            out.extend(self.programs[span >> 64][(span >> 32) & 0xFFFFFFFF : span & 0xFFFFFFFF])
            return
        start = len(out)
        if kind is Seq or kind is Alt:
            items = node.items  # type: ignore[attr-defined]
            out.extend((_SEQ if kind is Seq else _ALT, len(items)))
            emit, refs, literals = self.emit, self.refs, _LITERAL_CHUNKS
            # Leaves and references are most children: handled inline, without a call.
            for item in items:
                k = type(item)
                if k is Literal:
                    out.extend(literals.get(item.text) or _leaf(item))
                elif k is Ref:
                    out.extend(refs[item.name])
                elif k is CharClass:
                    out.extend(_leaf(item))
                else:
                    emit(item, out)
        elif kind is Repeat:
            out.extend(_repeat_head(node))  # type: ignore[arg-type]
            self.emit(node.item, out)  # type: ignore[attr-defined]
        else:
            _serialize_expr(node, self.index, out)  # subclasses and foreign nodes: the general path
        self.spans[id(node)] = self.rule << 64 | start << 32 | len(out)

    def rule_program(self, expr: Expr) -> list[int]:
        """Serialize the next rule's body (rules go in grammar order)."""
        code: list[int] = []
        self.rule = len(self.programs)
        self.programs.append(code)
        if type(expr) is KeySet:  # a whole key trie: one instruction (nested, the expansion below)
            code.extend(key_set_program(expr, self.index))
            return code
        if type(expr) is Check:  # only a whole rule body
            code.extend(check_program(expr, self.index))
            return code
        if type(expr) is UniqueItem:  # the marker word, then the item (only as a whole rule body)
            code.append(UNIQUE_OPCODE)
            expr = expr.item
        elif type(expr) is BoundedString:  # the marker and its bound, then the item
            code.extend((MAX_LENGTH_OPCODE, expr.max_length))
            expr = expr.item
        try:
            self.emit(expr, code)
        except RecursionError:
            # Nesting deeper than the interpreter's stack: the iterative walk writes the same program.
            code.clear()
            self.spans = {k: v for k, v in self.spans.items() if v >> 64 != self.rule}
            _serialize_expr(expr, self.index, code)
        return code


def serialize_grammar_python(
    grammar: Grammar, index: dict[str, int] | None = None
) -> tuple[list[list[int]], int]:
    """The rule programs and the root's rule index, written in Python (what the native serializer
    must match)."""
    if index is None:
        index = {name: i for i, (name, _) in enumerate(grammar.rules)}
    ser = _Serializer(index)
    for name, expr in grammar.rules:
        try:
            ser.rule_program(expr)
        except KeyError as exc:  # Grammar.unchecked skips the validation that reports this earlier
            raise GrammarDefinitionError(f"rule {name!r} refers to undefined rule {exc.args[0]!r}") from None
    return ser.programs, index[grammar.root]
