"""Per-request decoding parameters, validated once at construction."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from agent_infer.errors import InvalidRequestError

#: llama.cpp's default DRY sequence breakers: a repeat never spans a newline, a colon, a quote or an asterisk.
DRY_DEFAULT_BREAKERS: tuple[str, ...] = ("\n", ":", '"', "*")
# The most breakers one request may name (each is checked against every token in its DRY window).
_MAX_BREAKERS = 64


@dataclass(frozen=True)
class SamplingParams:
    """How one request is decoded.

    ``temperature == 0`` is greedy. ``top_k`` of 0 or -1 disables top-k. ``seed`` makes sampling
    reproducible per request, independent of what else is in the batch. ``logprobs=n`` returns the
    sampled token's log-probability plus the ``n`` most likely alternatives at every step.
    ``stop`` strings are cut from the returned text (kept, ending it, with
    ``include_stop_str_in_output``); ``stop_token_ids`` end the request like EOS.
    ``skip_special_tokens=False`` keeps special tokens' text in the output.
    Repetition control follows vLLM and OpenAI: ``repetition_penalty`` (> 0, 1 = off) divides the
    positive logits and multiplies the negative ones of every token already in the prompt or the
    output; ``presence_penalty`` and ``frequency_penalty`` (in [-2, 2], 0 = off) subtract a constant,
    and a constant per occurrence, from the logits of tokens already in the output.
    ``logit_bias`` maps token ids to a value in [-100, 100] added to that token's logit before
    sampling (OpenAI's semantics: -100 bans a token, +100 all but forces it; a grammar-masked token
    stays masked). ``min_tokens`` (vLLM's) keeps EOS and ``stop_token_ids`` from being sampled, and
    stop strings from ending the request, until that many tokens are generated; a grammar that can
    only end still ends the request.
    DRY ("Don't Repeat Yourself", llama.cpp's names and defaults; see ``engine/dry.py``) lowers the
    logit of a token that would extend a sequence already in the output by
    ``dry_multiplier * dry_base ** (n - dry_allowed_length)``, ``n`` the length of the repeat it
    extends (no penalty below ``dry_allowed_length``). ``dry_multiplier`` 0 turns it off (the
    default). The repeat never reaches back across a token whose text contains one of
    ``dry_sequence_breakers``; ``dry_penalty_last_n`` bounds how many output tokens are searched
    (-1: all, 0: off). ``dry_skip_whitespace`` makes tokens that are only whitespace transparent,
    so a repeat is found through changing indentation (JSON nesting).
    ``value_close_multiplier`` (> 0 turns it on; for JSON output, see ``engine/value_loops.py``)
    adds ``value_close_multiplier * (r - value_close_allowed)`` to the tokens that close the
    innermost open JSON value once it holds ``r > value_close_allowed`` repeated token bigrams.
    ``value_close_budget`` (a fraction of ``max_tokens`` in (0, 1], 0 = off; see
    ``engine/budget_close.py``) favours the grammar's way out (the first token of its shortest
    completion, or EOS) over the last part of the budget: up to ``value_close_budget_bias`` once
    the tokens left only just hold the closing.
    ``structured`` constrains the output to a grammar: a Pydantic model class, a JSON Schema dict,
    a list of choices, ``"json_object"``, a :class:`~agent_infer.grammar.Grammar`, or a
    :class:`~agent_infer.structured.StructuredOutput` (regex, EBNF, built-in grammars).
    ``close_on_length`` (constrained requests only): instead of stopping mid-document at
    ``max_tokens`` (finish reason ``length``), end with the grammar's shortest completion so the
    output always parses (finish reason ``stop``; ``metrics.num_closing_tokens`` counts the tokens
    the engine wrote). The shortest completion fills required parts with minimal values (``""``,
    ``0``, the first enum member), so the content of a closed document is cut short. Not
    combinable with ``logprobs`` (closing tokens are not sampled).
    Speculative decoding (``engine/speculator.py``), None = the engine's setting:
    ``speculative_source`` (``"auto"``, ``"mtp"``, ``"ngram"``, ``"off"``) picks the draft sources,
    ``speculative_tokens`` (0-32, capped by the engine's) the longest draft, and
    ``speculative_confidence`` (in [0, 1]) the MTP confidence schedule's base threshold. Outputs do
    not depend on them (verification keeps exactly what plain decoding chooses), only speed does.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 256
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    seed: int | None = None
    logprobs: int | None = None
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    structured: Any = None
    close_on_length: bool = False
    min_tokens: int = 0
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] | None = None
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_sequence_breakers: str | list[str] | tuple[str, ...] | None = DRY_DEFAULT_BREAKERS
    dry_penalty_last_n: int = -1
    dry_skip_whitespace: bool = False
    value_close_multiplier: float = 0.0
    value_close_allowed: int = 4
    value_close_budget: float = 0.0
    value_close_budget_bias: float = 8.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    speculative_source: str | None = None
    speculative_tokens: int | None = None
    speculative_confidence: float | None = None

    def __new__(cls, *args: Any, **kwargs: Any) -> SamplingParams:
        # The dataclass __init__ would raise a bare TypeError for a misspelt keyword; users should
        # get the typed error naming the field, so unknown keywords are rejected before __init__ runs.
        unknown = [key for key in kwargs if key not in _FIELD_NAMES]
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling parameter {unknown[0]!r}; known: {', '.join(sorted(_FIELD_NAMES))}",
                field=unknown[0],
            )
        if len(args) > len(_FIELD_NAMES):
            raise InvalidRequestError(
                f"SamplingParams takes at most {len(_FIELD_NAMES)} positional arguments"
            )
        return super().__new__(cls)

    def __post_init__(self) -> None:
        _check_number(self.temperature, "temperature")
        if self.temperature < 0:
            raise InvalidRequestError(
                f"temperature must be >= 0, got {self.temperature}", field="temperature"
            )
        _check_int(self.top_k, "top_k")
        if self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1, 0 (off) or positive, got {self.top_k}", field="top_k"
            )
        _check_number(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", field="top_p")
        _check_number(self.min_p, "min_p")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", field="min_p")
        _check_int(self.max_tokens, "max_tokens")
        if self.max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}", field="max_tokens")
        if self.seed is not None:
            _check_int(self.seed, "seed")
            # OpenAI's range; torch's generators take no more than 64 bits.
            if not -(2**63) <= self.seed < 2**63:
                raise InvalidRequestError(
                    f"seed must be a 64-bit signed integer, got {self.seed}", field="seed"
                )
        if self.logprobs is not None:
            _check_int(self.logprobs, "logprobs")
            if self.logprobs < 0:
                raise InvalidRequestError(f"logprobs must be >= 0, got {self.logprobs}", field="logprobs")
        _check_number(self.repetition_penalty, "repetition_penalty")
        if not 0.0 < self.repetition_penalty < float("inf"):
            raise InvalidRequestError(
                f"repetition_penalty must be > 0 and finite, got {self.repetition_penalty}",
                field="repetition_penalty",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(value, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", field=name)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be a bool", field=name)
        if not isinstance(self.close_on_length, bool):
            raise InvalidRequestError("close_on_length must be a bool", field="close_on_length")
        if self.close_on_length and self.logprobs is not None:
            raise InvalidRequestError(
                "close_on_length cannot be combined with logprobs: closing tokens are not sampled",
                field="close_on_length",
            )
        _check_int(self.min_tokens, "min_tokens")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
                field="min_tokens",
            )
        _check_dry(self)
        _check_speculative(self)
        object.__setattr__(self, "dry_sequence_breakers", _normalise_breakers(self.dry_sequence_breakers))
        object.__setattr__(self, "logit_bias", _normalise_bias(self.logit_bias))
        # Normalise to tuples so a frozen params object cannot be mutated through a shared list.
        object.__setattr__(self, "stop", _normalise_stop(self.stop))
        object.__setattr__(self, "stop_token_ids", _normalise_stop_ids(self.stop_token_ids))
        if self.structured is not None:
            # Imported here: the grammar package is only needed by constrained requests.
            from agent_infer.structured import as_structured

            object.__setattr__(self, "structured", as_structured(self.structured))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        """Build from a mapping (e.g. a JSON request body); an unknown key raises InvalidRequestError."""
        if not isinstance(data, Mapping):
            raise InvalidRequestError(f"sampling parameters must be a mapping, got {type(data).__name__}")
        return cls(**dict(data))

    @property
    def greedy(self) -> bool:
        """True when decoding picks the arg-max token (no randomness)."""
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """True when the sampler changes this request's logits: a repetition, presence or frequency
        penalty, ``logit_bias``, ``min_tokens`` or DRY (such requests draft only when DRY is the only
        one: see ``speculator.py``)."""
        return self._adjusts_besides_dry or self.dry or self.value_close or self.budget_close

    @property
    def _adjusts_besides_dry(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
            or self.min_tokens > 0
        )

    @property
    def only_dry(self) -> bool:
        """True when DRY and the value-loop closing bias are the only logit adjustments: penalties
        that draft verification applies
        row by row (``penalties.apply_dry_to_draft_rows``), so such requests may still draft; the
        value-loop closing bias is applied there too."""
        return (self.dry or self.value_close or self.budget_close) and not self._adjusts_besides_dry

    @property
    def value_close(self) -> bool:
        """True when the value-loop closing bias is on (``value_close_multiplier > 0``)."""
        return self.value_close_multiplier > 0.0

    @property
    def budget_close(self) -> bool:
        """True when the closing pressure near ``max_tokens`` is on (``value_close_budget > 0``)."""
        return self.value_close_budget > 0.0 and self.value_close_budget_bias > 0.0

    @property
    def dry(self) -> bool:
        """True when the DRY penalty is on (``dry_multiplier > 0`` and a non-empty window)."""
        return self.dry_multiplier > 0.0 and self.dry_penalty_last_n != 0

    @property
    def bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` as sorted ``(token id, bias)`` pairs (empty when none)."""
        return self.logit_bias if isinstance(self.logit_bias, tuple) else ()

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """The stop strings as a tuple (empty when none)."""
        return self.stop if isinstance(self.stop, tuple) else ()

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The stop token ids as a tuple (empty when none)."""
        return self.stop_token_ids if isinstance(self.stop_token_ids, tuple) else ()


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _check_number(value: object, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequestError(f"{field} must be a number, got {type(value).__name__}", field=field)
    if value != value:  # NaN compares unequal to itself and would slip through every range check
        raise InvalidRequestError(f"{field} must not be NaN", field=field)


def _check_int(value: object, field: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{field} must be an integer, got {type(value).__name__}", field=field)


#: Values of ``speculative_source`` (the engine's ``drafts.base.SOURCE_MODES``).
SPECULATIVE_SOURCES = ("auto", "mtp", "ngram", "off")
#: Longest draft a request may ask for (the engine's own limit).
MAX_SPECULATIVE_TOKENS = 32


def _check_speculative(p: SamplingParams) -> None:
    if p.speculative_source is not None and p.speculative_source not in SPECULATIVE_SOURCES:
        raise InvalidRequestError(
            f"speculative_source must be one of {', '.join(SPECULATIVE_SOURCES)}, got {p.speculative_source!r}",
            field="speculative_source",
        )
    if p.speculative_tokens is not None:
        _check_int(p.speculative_tokens, "speculative_tokens")
        if not 0 <= p.speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise InvalidRequestError(
                f"speculative_tokens must be in [0, {MAX_SPECULATIVE_TOKENS}], got {p.speculative_tokens}",
                field="speculative_tokens",
            )
    if p.speculative_confidence is not None:
        _check_number(p.speculative_confidence, "speculative_confidence")
        if not 0.0 <= p.speculative_confidence <= 1.0:
            raise InvalidRequestError(
                f"speculative_confidence must be in [0, 1], got {p.speculative_confidence}",
                field="speculative_confidence",
            )


def _check_dry(p: SamplingParams) -> None:
    _check_number(p.value_close_multiplier, "value_close_multiplier")
    if not 0.0 <= p.value_close_multiplier < float("inf"):
        raise InvalidRequestError(
            f"value_close_multiplier must be >= 0 and finite (0 = off), got {p.value_close_multiplier}",
            field="value_close_multiplier",
        )
    _check_int(p.value_close_allowed, "value_close_allowed")
    if p.value_close_allowed < 0:
        raise InvalidRequestError(
            f"value_close_allowed must be >= 0, got {p.value_close_allowed}", field="value_close_allowed"
        )
    _check_number(p.value_close_budget, "value_close_budget")
    if not 0.0 <= p.value_close_budget <= 1.0:
        raise InvalidRequestError(
            f"value_close_budget must be in [0, 1] (a fraction of max_tokens, 0 = off), got {p.value_close_budget}",
            field="value_close_budget",
        )
    _check_number(p.value_close_budget_bias, "value_close_budget_bias")
    if not 0.0 <= p.value_close_budget_bias < float("inf"):
        raise InvalidRequestError(
            f"value_close_budget_bias must be >= 0 and finite, got {p.value_close_budget_bias}",
            field="value_close_budget_bias",
        )
    _check_number(p.dry_multiplier, "dry_multiplier")
    if not 0.0 <= p.dry_multiplier < float("inf"):
        raise InvalidRequestError(
            f"dry_multiplier must be >= 0 and finite (0 = off), got {p.dry_multiplier}",
            field="dry_multiplier",
        )
    _check_number(p.dry_base, "dry_base")
    if not 1.0 <= p.dry_base < float("inf"):
        raise InvalidRequestError(f"dry_base must be >= 1 and finite, got {p.dry_base}", field="dry_base")
    _check_int(p.dry_allowed_length, "dry_allowed_length")
    if p.dry_allowed_length < 1:
        raise InvalidRequestError(
            f"dry_allowed_length must be >= 1, got {p.dry_allowed_length}", field="dry_allowed_length"
        )
    _check_int(p.dry_penalty_last_n, "dry_penalty_last_n")
    if p.dry_penalty_last_n < -1:
        raise InvalidRequestError(
            f"dry_penalty_last_n must be -1 (whole output), 0 (off) or positive, got {p.dry_penalty_last_n}",
            field="dry_penalty_last_n",
        )
    if not isinstance(p.dry_skip_whitespace, bool):
        raise InvalidRequestError("dry_skip_whitespace must be a bool", field="dry_skip_whitespace")


def _normalise_breakers(breakers: object) -> tuple[str, ...]:
    if breakers is None:
        return ()
    items = [breakers] if isinstance(breakers, str) else breakers
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise InvalidRequestError(
            "dry_sequence_breakers must be a list of strings", field="dry_sequence_breakers"
        )
    if any(s == "" for s in items):
        raise InvalidRequestError(
            "dry_sequence_breakers must be non-empty strings", field="dry_sequence_breakers"
        )
    if len(items) > _MAX_BREAKERS:
        raise InvalidRequestError(
            f"dry_sequence_breakers holds at most {_MAX_BREAKERS} strings, got {len(items)}",
            field="dry_sequence_breakers",
        )
    return tuple(dict.fromkeys(items))


def _normalise_bias(bias: object) -> tuple[tuple[int, float], ...] | None:
    """``logit_bias`` as sorted ``(token id, bias)`` pairs: hashable, and cheap to apply."""
    if bias is None:
        return None
    if isinstance(bias, Mapping):
        items: list[Any] = list(bias.items())
    elif isinstance(bias, (tuple, list)):
        items = list(bias)
    else:
        raise InvalidRequestError("logit_bias must map token ids to numbers", field="logit_bias")
    pairs: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise InvalidRequestError("logit_bias must map token ids to numbers", field="logit_bias")
        token, value = item
        where = f"logit_bias.{token}"
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidRequestError(f"logit_bias key {token!r} is not a token id", field=where)
        _check_number(value, where)
        if not -100.0 <= value <= 100.0:
            raise InvalidRequestError(
                f"logit_bias for token {token} must be in [-100, 100], got {value}", field=where
            )
        pairs[token] = float(value)
    return tuple(sorted(pairs.items())) or None


def _normalise_stop(stop: object) -> tuple[str, ...] | None:
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise InvalidRequestError("stop must be a string or a list of strings", field="stop")
    if any(s == "" for s in items):
        raise InvalidRequestError("stop strings must be non-empty", field="stop")
    return tuple(items) or None


def _normalise_stop_ids(ids: object) -> tuple[int, ...] | None:
    if ids is None:
        return None
    if not isinstance(ids, (list, tuple)) or not all(
        isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
    ):
        raise InvalidRequestError(
            "stop_token_ids must be a list of non-negative integers", field="stop_token_ids"
        )
    return tuple(ids) or None
