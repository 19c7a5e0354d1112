"""Structured generation shared by the sync and async clients: decode, validate, re-ask, stream partials.

The retry logic is a generator (``generate_flow``) that yields each :class:`ModelRequest` and is sent
the :class:`ModelResponse`; ``Client`` drives it with blocking calls and ``AsyncClient`` with
``await``, so both behave identically.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Generator
from typing import Any

import pydantic

from agent_infer.client.hooks import ParseErrorEvent
from agent_infer.client.partial_json import Node, PartialJSON, PartialJSONError, partial_model
from agent_infer.client.request import Completion, Constraint, ModelRequest, ModelResponse, Usage
from agent_infer.errors import ValidationRetryError

__all__ = ["OutputInvalid", "PartialStream", "decode", "generate_flow"]


class OutputInvalid(Exception):
    """Internal: one output failed validation; the message is what the model is told."""


def decode(constraint: Constraint | None, text: str, finish_reason: str, context: Any = None) -> Any:
    """The value of one output under ``constraint``: a model instance, parsed JSON, or the text.

    ``context`` is the Pydantic validation context (``info.context`` in validators).

    Raises :class:`OutputInvalid` when the output was cut off or does not validate (validators
    beyond the schema locally; anything at all from a remote server that ignored the constraint).
    """
    if constraint is None:
        return text  # free text cut at max_tokens is still an answer
    if finish_reason == "length":
        raise OutputInvalid("the output was cut off at max_tokens before it was complete")
    if constraint.kind == "grammar":
        return text
    if constraint.kind == "choice":
        if text not in constraint.value:
            raise OutputInvalid(f"{text!r} is not one of {list(constraint.value)!r}")
        return text
    if constraint.kind == "regex":
        if re.fullmatch(constraint.value, text) is None:
            raise OutputInvalid(f"{text!r} does not match the pattern {constraint.value!r}")
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise OutputInvalid(f"the output is not valid JSON: {exc}") from None
    if constraint.model is not None:
        try:
            return constraint.validate(value, context)
        except pydantic.ValidationError as exc:
            raise OutputInvalid(_pydantic_errors(exc)) from None
    _check_json_schema(constraint.value, value)
    return value


def _pydantic_errors(exc: pydantic.ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(x) for x in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors(include_url=False)
    )


def _check_json_schema(schema: Any, value: Any) -> None:
    """Dict schemas: checked with ``jsonschema`` when it is installed (grammar-constrained output
    already conforms; this catches a remote server that did not constrain)."""
    try:
        import jsonschema
    except ImportError:
        return
    problems = list(jsonschema.Draft202012Validator(schema).iter_errors(value))
    if problems:
        raise OutputInvalid(
            "; ".join(f"/{'/'.join(map(str, p.absolute_path))}: {p.message}" for p in problems)
        )


def _feedback(error: str) -> str:
    return f"That answer failed validation: {error}\nAnswer again with the problems fixed."


def _next_attempt(
    request: ModelRequest, text: str, error: str, finish_reason: str, last: bool
) -> ModelRequest:
    """The request of the attempt after a failed one.

    A validation error is shown to the model with its answer. An output cut off at ``max_tokens``
    is almost always a loop inside a value: showing it again would prime the same loop, so the
    conversation stays as it was and the decoding changes instead: the loop control is escalated
    (a larger DRY penalty, see ``loop_control.py``), a sampled call halves its temperature
    (rambling grows with it) and a seeded one moves to the next seed, and the last attempt
    (``last``; like every call no retry follows, it decodes with the closing pressure near
    ``max_tokens``) ends with the grammar's shortest completion if it runs out of tokens again
    (``close_on_length``: the value is cut short, not lost). With ``loop_control=False`` a
    ``length`` failure is re-asked like a validation error.
    """
    if finish_reason == "length" and request.constraint is not None and request.loop_control is not False:
        seed = request.seed + 1 if request.seed is not None and request.seed + 1 < 2**63 else request.seed
        return dataclasses.replace(
            request,
            loop_escalation=request.loop_escalation + 1,
            seed=seed,
            temperature=request.temperature / 2,
            loop_last_attempt=last,
        )
    messages = [
        *request.messages,
        {"role": "assistant", "content": text},
        {"role": "user", "content": _feedback(error)},
    ]
    return dataclasses.replace(request, messages=messages)


def generate_flow(
    request: ModelRequest, max_retries: int, context: Any = None
) -> Generator[ModelRequest | ParseErrorEvent, Any, tuple[Any, Completion]]:
    """Ask, validate (``context`` reaching the validators), and re-ask at most ``max_retries`` times:
    with the validation error appended, or after a ``length`` failure with the same conversation and
    stronger loop control (``_next_attempt``). Each failure is also yielded as a
    :class:`ParseErrorEvent` for the hooks (sent back None).

    Returns the value and the :class:`Completion` of the attempt that produced it.
    """
    raw_outputs: list[str] = []
    errors: list[str] = []
    usage = Usage()
    attempt_request = request
    for attempt in range(1, max_retries + 2):
        attempt_request = dataclasses.replace(attempt_request, retried_on_length=attempt <= max_retries)
        response: ModelResponse = yield attempt_request
        usage = usage + response.usage
        text = response.content
        try:
            value = decode(request.constraint, text, response.finish_reason, context)
        except OutputInvalid as exc:
            raw_outputs.append(text)
            errors.append(str(exc))
            yield ParseErrorEvent(text, str(exc), attempt)
            last = attempt == max_retries
            attempt_request = _next_attempt(attempt_request, text, str(exc), response.finish_reason, last)
            continue
        raw = response.raw_text if response.raw_text is not None else text
        return value, Completion(raw, response.message, response.finish_reason, usage, attempt)
    raise ValidationRetryError(
        f"no valid output after {len(raw_outputs)} attempt(s)", raw_outputs=raw_outputs, errors=errors
    )


class PartialStream:
    """Turns streamed text into partial values (see :mod:`partial_json`); ``finish`` gives the final value.

    JSON schemas yield partial objects (Pydantic partials built with ``model_construct`` for a
    model, plain dicts for a dict schema) whenever the prefix-consistent view changes; other
    constraints yield the text so far.
    """

    def __init__(self, constraint: Constraint | None, context: Any = None) -> None:
        self._constraint = constraint
        self._context = context
        self._parser = PartialJSON() if constraint is not None and constraint.is_json else None
        self._text = ""
        self._last: Any = None
        self._emitted = 0  # Iterable[Item]: the items already yielded

    def feed(self, delta: str) -> list[Any]:
        """Add streamed text; returns the partial values that became visible (zero or one)."""
        if not delta:
            return []
        self._text += delta
        if self._parser is None:
            return [self._text]
        try:
            self._parser.feed(delta)
        except PartialJSONError:
            return []  # not JSON (a server that ignored the constraint): decided in finish()
        root = self._parser.root
        if root is None:
            return []
        assert self._constraint is not None
        if self._constraint.item is not None:
            return self._closed_items(root)
        view = root.to_python()
        if view == self._last:
            return []
        self._last = view
        if self._constraint.is_model:
            return [partial_model(root, self._constraint.model, self._context)]
        return [view]

    def _closed_items(self, root: Node) -> list[Any]:
        """``Iterable[Item]``: each item of the root array that closed since the last call, validated.

        Items close in order, so the first open one ends the scan. An item that fails validation
        raises at once: the caller may already act on the items before it, and must not on it.
        """
        if root.kind != "array":
            return []
        assert self._constraint is not None
        adapter = _item_adapter(self._constraint.item)
        items: list[Any] = []
        for _, child in root.children[self._emitted :]:
            if not child.closed:
                break
            try:
                items.append(adapter.validate_python(child.to_python(), context=self._context))
            except pydantic.ValidationError as exc:
                error = f"item {self._emitted}: {_pydantic_errors(exc)}"
                raise ValidationRetryError(
                    "a streamed item is not valid", raw_outputs=[self._text], errors=[error]
                ) from None
            self._emitted += 1
        return items

    def finish(self, finish_reason: str) -> Any:
        """The validated final value; :class:`ValidationRetryError` (one attempt) when it is not valid."""
        try:
            return decode(self._constraint, self._text, finish_reason, self._context)
        except OutputInvalid as exc:
            raise ValidationRetryError(
                "the streamed output is not valid", raw_outputs=[self._text], errors=[str(exc)]
            ) from None

    def finish_items(self, finish_reason: str) -> list[Any]:
        """What the stream yields at its end: the final value, or for ``Iterable[Item]`` the items
        not yielded yet (the whole list is validated first)."""
        final = self.finish(finish_reason)
        if self._constraint is None or self._constraint.item is None:
            return [final]
        rest: list[Any] = final[self._emitted :]
        self._emitted = len(final)
        return rest


@functools.lru_cache(maxsize=64)
def _item_adapter(item: Any) -> pydantic.TypeAdapter[Any]:
    return pydantic.TypeAdapter(item)
