"""Request-level constraints: what ``SamplingParams(structured=...)`` accepts, and how it becomes a grammar.

One normal form, :class:`StructuredOutput`, built by explicit constructors or by
:func:`as_structured` from the shorthand users write:

* a Pydantic model class or a JSON Schema dict -> ``json_schema``
* a :class:`~agent_infer.grammar.ir.Grammar` -> ``grammar``
* a list/tuple of strings -> ``choice``
* ``"json_object"`` -> any JSON object
* a ``StructuredOutput`` -> itself

Plain strings other than ``"json_object"`` are ambiguous (regex? GBNF? schema text?) and are rejected
with a message naming the explicit constructors.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from agent_infer.errors import ConfigError, InvalidRequestError
from agent_infer.grammar.ir import Grammar

_KINDS = ("json_schema", "json_object", "regex", "ebnf", "choice", "builtin", "grammar")
# Grammar.from_json_schema's options and their defaults (what check_options needs for those not given).
_SCHEMA_DEFAULTS: dict[str, Any] = {
    "strict": True,
    "whitespace": "flexible",
    "max_whitespace": 2,
    "indent": None,
    "remotes": None,
    "unknown_formats": "ignore",
    "unknown_keywords": "ignore",
    "numbers": "float64",
}
# A request generates numbers under the float64 digit policy unless it asks for numbers="exact":
# the output is one valid instance, and digits past float64's precision are a loop, not a value
# (grammar/frontends/json_schema/types/number_policy.py). Grammar.from_json_schema, which also
# recognizes instances, keeps JSON Schema's unbounded numbers by default.
REQUEST_NUMBERS = "float64"


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on one request's output. Build it with the classmethods."""

    kind: str
    value: Any
    options: tuple[tuple[str, Any], ...] = field(default=())
    model: Any = field(default=None, compare=False)  # the Pydantic class, when given one

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise InvalidRequestError(
                f"unknown structured kind {self.kind!r}; expected one of {', '.join(_KINDS)}",
                field="structured",
            )

    @classmethod
    def json_schema(cls, schema: Any, **options: Any) -> StructuredOutput:
        """A JSON Schema (dict or JSON text) or a Pydantic model class; ``options`` are
        ``Grammar.from_json_schema``'s (``strict``, ``whitespace``, ``unknown_formats``, ...),
        checked here: an unknown one, or a value out of range, raises ConfigError naming it."""
        from agent_infer.grammar.frontends.json_schema import check_options, load_schema

        model = schema if isinstance(schema, type) else None
        _check_schema_options(options, check_options)
        if isinstance(schema, str):
            # The front end's parser: its errors name the problem (and keep over-long integers
            # as text so the compiler can point at the keyword holding one).
            schema = load_schema(schema)
        return cls("json_schema", schema, tuple(sorted(options.items())), model)

    @classmethod
    def json_object(cls) -> StructuredOutput:
        """Any JSON object (OpenAI's ``json_object`` mode)."""
        return cls("json_object", None)

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        """Text fully matching a Python-syntax regex."""
        return cls("regex", pattern)

    @classmethod
    def ebnf(cls, text: str, *, syntax: str = "gbnf", start: str | None = None) -> StructuredOutput:
        """An EBNF grammar in GBNF or Lark syntax."""
        return cls("ebnf", text, (("start", start), ("syntax", syntax)))

    @classmethod
    def choice(cls, options: Sequence[str]) -> StructuredOutput:
        """Exactly one of the given strings."""
        return cls("choice", tuple(options))

    @classmethod
    def builtin(cls, name: str) -> StructuredOutput:
        """A grammar shipped in ``grammars/`` (json, arithmetic, sql_select, ...)."""
        return cls("builtin", name)

    @classmethod
    def grammar(cls, grammar: Grammar) -> StructuredOutput:
        """An IR grammar built in code."""
        return cls("grammar", grammar)

    def to_grammar(self) -> Grammar:
        """Lower to the grammar IR (front-end errors propagate as typed GrammarErrors)."""
        opts = dict(self.options)
        if self.kind == "json_schema":
            opts.setdefault("numbers", REQUEST_NUMBERS)
            return Grammar.from_json_schema(self.model or self.value, **opts)
        if self.kind == "json_object":
            return Grammar.from_json_schema({"type": "object"}, numbers=REQUEST_NUMBERS)
        if self.kind == "regex":
            return Grammar.from_regex(self.value)
        if self.kind == "ebnf":
            return Grammar.from_ebnf(self.value, syntax=opts.get("syntax", "gbnf"), start=opts.get("start"))
        if self.kind == "choice":
            return Grammar.choice(list(self.value))
        if self.kind == "builtin":
            return Grammar.builtin(self.value)
        return self.value

    @property
    def is_json(self) -> bool:
        """True when outputs are JSON documents (so they can be parsed into objects)."""
        return self.kind in ("json_schema", "json_object") or (
            self.kind == "builtin" and self.value == "json"
        )


def _check_schema_options(options: dict[str, Any], check: Any) -> None:
    """ConfigError for an option ``Grammar.from_json_schema`` does not take or a value it rejects."""
    unknown = sorted(set(options) - set(_SCHEMA_DEFAULTS))
    if unknown:
        raise ConfigError(
            f"StructuredOutput.json_schema got unknown option(s) {', '.join(unknown)}; "
            f"it takes {', '.join(sorted(_SCHEMA_DEFAULTS))}"
        )
    check(**{**_SCHEMA_DEFAULTS, **options})


def as_structured(value: Any) -> StructuredOutput:
    """Normalize the shorthand accepted by ``SamplingParams(structured=...)``."""
    if isinstance(value, StructuredOutput):
        return value
    if isinstance(value, Grammar):
        return StructuredOutput.grammar(value)
    if isinstance(value, type) and hasattr(value, "model_json_schema"):
        return StructuredOutput.json_schema(value)
    if isinstance(value, dict | bool):
        return StructuredOutput.json_schema(value)
    if isinstance(value, list | tuple) and value and all(isinstance(v, str) for v in value):
        return StructuredOutput.choice(value)
    if value == "json_object":
        return StructuredOutput.json_object()
    raise InvalidRequestError(
        f"cannot tell what constraint {value!r} is; use StructuredOutput.json_schema/regex/ebnf/choice/"
        "builtin/grammar, a Pydantic model class, a JSON Schema dict, a list of choices, or 'json_object'",
        field="structured",
    )
