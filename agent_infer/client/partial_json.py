"""An incremental JSON parser for streaming: feed text as it arrives, read a partial value at any time.

The parser keeps a tree of :class:`Node`\\ s, each marked ``closed`` once its last character has
arrived. A partial view (:meth:`PartialJSON.snapshot`) is *prefix-consistent* with the final value:

* a closed value equals the final value at that position;
* an open string is a prefix of the final string;
* an open object has a subset of the final keys, in order, each value prefix-consistent;
* an open array has the first items of the final array, each prefix-consistent.

Numbers, ``true``/``false``/``null`` and object keys only appear once complete, because ``1`` may
still become ``12``. :func:`partial_model` turns a tree into Pydantic instances where only closed
subtrees are validated, so validators never see half a value.
"""

from __future__ import annotations

import enum
import functools
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import pydantic

from agent_infer.errors import AgentInferError

__all__ = ["Node", "PartialJSON", "PartialJSONError", "is_prefix_of", "model_to_python", "partial_model"]


class PartialJSONError(AgentInferError, ValueError):
    """The streamed text is not a prefix of any JSON value; ``position`` is the offending character."""

    def __init__(self, message: str, *, position: int) -> None:
        super().__init__(f"{message} (position {position})")
        self.position = position


@dataclass
class Node:
    """One JSON value: ``kind`` is object, array, string or scalar; ``closed`` once fully read."""

    kind: str
    value: Any
    closed: bool = False
    children: list[tuple[str | None, Node]] = field(default_factory=list)

    def to_python(self) -> Any:
        """The prefix-consistent Python value of this node."""
        if self.kind == "object":
            return {key: child.to_python() for key, child in self.children}
        if self.kind == "array":
            return [child.to_python() for _, child in self.children]
        if (
            self.kind == "string"
            and not self.closed
            and self.value
            and 0xD800 <= ord(self.value[-1]) <= 0xDBFF
        ):
            return self.value[:-1]  # half a surrogate pair is not text yet
        return self.value


_SCALAR_START = set("-0123456789tfn")
_SCALAR_CHARS = set("-+.eE0123456789truefalsn")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_WS = " \t\n\r"

# Parser states.
_VALUE, _KEY_OR_END, _KEY, _COLON, _AFTER, _VALUE_OR_END, _STRING, _SCALAR, _END = range(9)


class PartialJSON:
    """Feed JSON text piece by piece; ``root`` is the tree so far, ``done`` once the value is complete."""

    def __init__(self) -> None:
        self.root: Node | None = None
        self._stack: list[Node] = []
        self._state = _VALUE
        self._pos = 0
        self._key: str | None = None
        self._buf: list[str] = []  # the scalar or key being read
        self._string: Node | None = None  # the value string being read (None: reading a key)
        self._escape: str | None = None  # None, "\\" right after a backslash, or "u...." hex so far

    @property
    def done(self) -> bool:
        """True once a complete JSON value has been read (only whitespace may follow)."""
        return self._state == _END

    def feed(self, text: str) -> None:
        """Consume more text; raises :class:`PartialJSONError` if it cannot continue a JSON value."""
        for ch in text:
            self._char(ch)
            self._pos += 1

    def finish(self) -> Any:
        """End of input: the complete value (a number at the root is closed here)."""
        if self._state == _SCALAR and len(self._stack) == 0:
            self._close_scalar()
        if not self.done or self.root is None:
            raise PartialJSONError("the JSON value is incomplete", position=self._pos)
        return self.root.to_python()

    def snapshot(self) -> Any:
        """The prefix-consistent partial value (None before any value has started)."""
        return None if self.root is None else self.root.to_python()

    # -- the state machine --

    def _fail(self, ch: str) -> typing.NoReturn:
        raise PartialJSONError(f"unexpected character {ch!r} in JSON", position=self._pos)

    def _char(self, ch: str) -> None:
        state = self._state
        if state == _STRING:
            self._string_char(ch)
        elif state == _SCALAR:
            if ch in _SCALAR_CHARS:
                self._buf.append(ch)
                return
            self._close_scalar()
            self._char(ch)
        elif ch in _WS:
            return
        elif state in (_VALUE, _VALUE_OR_END):
            if state == _VALUE_OR_END and ch == "]":
                self._close_container()
            else:
                self._start_value(ch)
        elif state in (_KEY_OR_END, _KEY):
            if ch == '"':
                self._string, self._buf, self._state = None, [], _STRING
            elif ch == "}" and state == _KEY_OR_END:
                self._close_container()
            else:
                self._fail(ch)
        elif state == _COLON:
            if ch != ":":
                self._fail(ch)
            self._state = _VALUE
        elif state == _AFTER:
            top = self._stack[-1]
            if ch == ",":
                self._state = _KEY if top.kind == "object" else _VALUE
            elif (ch == "}" and top.kind == "object") or (ch == "]" and top.kind == "array"):
                self._close_container()
            else:
                self._fail(ch)
        else:  # _END: only whitespace may follow a complete value
            self._fail(ch)

    def _start_value(self, ch: str) -> None:
        if ch == "{":
            node = Node("object", None)
            self._attach(node)
            self._stack.append(node)
            self._state = _KEY_OR_END
        elif ch == "[":
            node = Node("array", None)
            self._attach(node)
            self._stack.append(node)
            self._state = _VALUE_OR_END
        elif ch == '"':
            self._string = Node("string", "")
            self._attach(self._string)
            self._state = _STRING
        elif ch in _SCALAR_START:
            self._buf = [ch]
            self._state = _SCALAR
        else:
            self._fail(ch)

    def _attach(self, node: Node) -> None:
        if not self._stack:
            self.root = node
            return
        parent = self._stack[-1]
        parent.children.append((self._key if parent.kind == "object" else None, node))

    def _after_value(self) -> None:
        self._state = _AFTER if self._stack else _END

    def _close_container(self) -> None:
        self._stack.pop().closed = True
        self._after_value()

    def _close_scalar(self) -> None:
        text = "".join(self._buf)
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise PartialJSONError(f"invalid JSON literal {text!r}", position=self._pos) from None
        self._attach(Node("scalar", value, closed=True))
        self._after_value()

    def _string_char(self, ch: str) -> None:
        if self._escape is not None:
            decoded = self._escape_char(ch)
            if decoded is None:
                return
            ch = decoded
        elif ch == "\\":
            self._escape = "\\"
            return
        elif ch == '"':
            self._end_string()
            return
        if self._string is None:
            self._buf.append(ch)
        else:
            self._string.value += ch

    def _escape_char(self, ch: str) -> str | None:
        """Advance an escape sequence; the decoded character once it is complete."""
        esc = self._escape or ""
        if esc == "\\":
            if ch == "u":
                self._escape = "u"
                return None
            if ch not in _ESCAPES:
                self._fail(ch)
            self._escape = None
            return _ESCAPES[ch]
        if ch not in "0123456789abcdefABCDEF":
            self._fail(ch)
        esc += ch
        if len(esc) < 5:
            self._escape = esc
            return None
        self._escape = None
        code = int(esc[1:], 16)
        if 0xDC00 <= code <= 0xDFFF:
            # A low surrogate right after a high one: join the pair into one character.
            prev = self._string.value[-1:] if self._string is not None else "".join(self._buf[-1:])
            if prev and 0xD800 <= ord(prev) <= 0xDBFF:
                if self._string is not None:
                    self._string.value = self._string.value[:-1]
                else:
                    self._buf.pop()
                return chr(0x10000 + ((ord(prev) - 0xD800) << 10) + (code - 0xDC00))
        return chr(code)

    def _end_string(self) -> None:
        if self._string is None:  # a key
            self._key = "".join(self._buf)
            self._state = _COLON
            return
        self._string.closed = True
        self._string = None
        self._after_value()


def is_prefix_of(partial: Any, final: Any) -> bool:
    """Whether ``partial`` is a prefix-consistent view of ``final`` (the rule in the module docstring)."""
    if isinstance(partial, dict) and isinstance(final, dict):
        keys = list(final)
        if list(partial) != keys[: len(partial)]:
            return False
        return all(is_prefix_of(v, final[k]) for k, v in partial.items())
    if isinstance(partial, list) and isinstance(final, list):
        return len(partial) <= len(final) and all(is_prefix_of(p, f) for p, f in zip(partial, final))
    if isinstance(partial, str) and isinstance(final, str):
        return final.startswith(partial)
    return bool(partial == final and type(partial) is type(final))


# --- Pydantic views --------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _adapter(annotation: Any) -> pydantic.TypeAdapter[Any]:
    return pydantic.TypeAdapter(annotation)


def _validate(annotation: Any, value: Any, context: Any = None) -> Any:
    try:
        adapter = _adapter(annotation)
    except TypeError:  # an unhashable annotation cannot be cached
        adapter = pydantic.TypeAdapter(annotation)
    try:
        return adapter.validate_python(value, context=context)
    except pydantic.ValidationError:
        # Validators beyond the schema decide on the whole object at the end; a partial shows the raw value.
        return value


def _unwrap(annotation: Any) -> Any:
    """Strip ``Annotated`` and ``Optional`` so the shape of a partial value can be followed."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(args) != 1:
                return annotation
            annotation = args[0]
        else:
            return annotation


def partial_model(node: Node, annotation: Any, context: Any = None) -> Any:
    """A partial value typed by ``annotation``: closed subtrees validated (``context`` reaching their
    validators), open models built field by field.

    An open object whose annotation is a Pydantic model becomes ``Model.model_construct`` with only
    the fields that have arrived (``model_fields_set``); missing fields are absent attributes, so
    read them with ``getattr(obj, name, None)``.
    """
    if node.closed:
        return _validate(annotation, node.to_python(), context)
    target = _unwrap(annotation)
    if node.kind == "object" and isinstance(target, type) and issubclass(target, pydantic.BaseModel):
        by_key = {(f.alias or name): name for name, f in target.model_fields.items()}
        values: dict[str, Any] = {}
        for key, child in node.children:
            name = by_key.get(key or "")
            if name is not None:
                values[name] = partial_model(child, target.model_fields[name].annotation, context)
        instance = target.model_construct(_fields_set=set(values), **values)
        for name in target.model_fields:
            if name not in values:
                instance.__dict__.pop(name, None)  # model_construct filled in a default that has not arrived
        return instance
    if node.kind == "array" and typing.get_origin(target) in (list, tuple, set, frozenset):
        args = typing.get_args(target)
        item = args[0] if args else Any
        return [partial_model(child, item, context) for _, child in node.children]
    return node.to_python()


def model_to_python(value: Any) -> Any:
    """The JSON-like view of a partial (for comparing with :func:`is_prefix_of`): fields that arrived only."""
    if isinstance(value, pydantic.BaseModel):
        fields = type(value).model_fields
        return {
            (fields[name].alias or name): model_to_python(value.__dict__[name])
            for name in fields
            if name in value.model_fields_set and name in value.__dict__
        }
    if isinstance(value, list | tuple):
        return [model_to_python(v) for v in value]
    if isinstance(value, dict):
        return {k: model_to_python(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value  # a member stands for its JSON value
    return value
