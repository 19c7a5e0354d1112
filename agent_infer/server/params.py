"""Request bodies -> engine inputs: sampling parameters, output constraints and logprobs shapes."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent_infer.errors import GrammarError, InvalidRequestError
from agent_infer.grammar.frontends.regex.parser import regex_to_grammar
from agent_infer.grammar.ir import Grammar
from agent_infer.model.tokenizer import Tokenizer
from agent_infer.sampling_params import SamplingParams
from agent_infer.server.async_engine import RequestStream
from agent_infer.server.body import parse_json
from agent_infer.server.errors import ApiError, constraint_error
from agent_infer.server.protocol import ChatCompletionRequest, CompletionRequest
from agent_infer.structured import StructuredOutput


@dataclass(frozen=True)
class Constraint:
    """A request's output constraint, the request field it came from, and what it could not enforce."""

    structured: StructuredOutput | None = None
    field: str | None = None
    warnings: tuple[str, ...] = ()


def _lenient_schema(schema: Any, where: str, options: dict[str, Any]) -> Constraint:
    # strict=false: keywords the compiler cannot enforce are skipped, and the response says which.
    try:
        grammar = Grammar.from_json_schema(schema, strict=False, **options)
    except GrammarError as exc:
        raise constraint_error(exc, where) from exc
    return Constraint(StructuredOutput.grammar(grammar), where, tuple(grammar.warnings))


def vllm_regex(pattern: str, where: str) -> Grammar:
    """``structured_outputs.regex`` as vLLM reads it: ECMAScript syntax, ASCII ``\\d`` and ``\\w``.

    vLLM's grammar backends take the pattern as ECMAScript (JavaScript) syntax, so ``\\d`` is
    ``[0-9]`` there; Python's ``re`` (what :meth:`StructuredOutput.regex` keeps for the Python API)
    would let a "digit" be any Unicode decimal digit. ``\\s`` is ECMAScript's white space.
    """
    try:
        return regex_to_grammar(pattern, dialect="ecma")
    except GrammarError as exc:
        raise constraint_error(exc, where) from exc


def build_constraint(req: ChatCompletionRequest | CompletionRequest) -> Constraint:
    """The constraint of ``response_format`` or ``structured_outputs`` and the field it came from."""
    fmt = req.response_format
    so = req.structured_outputs
    wants_format = fmt is not None and fmt.type != "text"
    if wants_format and so is not None:
        raise ApiError(
            400, "give either response_format or structured_outputs, not both", param="structured_outputs"
        )
    if fmt is not None:
        if fmt.type == "json_object":
            return Constraint(StructuredOutput.json_object(), "response_format")
        if fmt.type == "json_schema":
            spec = fmt.json_schema
            if spec is None or spec.schema_ is None:
                raise ApiError(
                    400, "response_format.json_schema.schema is required", param="response_format.json_schema"
                )
            where = "response_format.json_schema.schema"
            if spec.strict is False:
                return _lenient_schema(spec.schema_, where, spec.frontend_options())
            return Constraint(StructuredOutput.json_schema(spec.schema_, **spec.frontend_options()), where)
        if fmt.json_schema is not None:
            raise ApiError(
                400, "response_format.json_schema needs type 'json_schema'", param="response_format.type"
            )
    if so is None:
        return Constraint()
    given = {
        name: value
        for name, value in (
            ("json", so.json_),
            ("regex", so.regex),
            ("grammar", so.grammar),
            ("choice", so.choice),
            ("json_object", so.json_object or None),
        )
        if value is not None
    }
    if len(given) != 1:
        raise ApiError(
            400,
            f"structured_outputs needs exactly one of json, regex, grammar, choice, json_object; got {sorted(given) or 'none'}",
            param="structured_outputs",
        )
    name = next(iter(given))
    where = f"structured_outputs.{name}"
    try:
        if so.json_ is not None:
            # Schema text is parsed here so that its nesting is bounded like the body's.
            schema = parse_json(so.json_, where, where) if isinstance(so.json_, str) else so.json_
            return Constraint(StructuredOutput.json_schema(schema), where)
        if so.regex is not None:
            return Constraint(StructuredOutput.grammar(vllm_regex(so.regex, where)), where)
        if so.grammar is not None:
            # GBNF writes rules with ``::=``; Lark with ``:``.
            syntax = "gbnf" if "::=" in so.grammar else "lark"
            return Constraint(StructuredOutput.ebnf(so.grammar, syntax=syntax), where)
        if so.choice is not None:
            if not so.choice:
                raise ApiError(400, "structured_outputs.choice needs at least one option", param=where)
            return Constraint(StructuredOutput.choice(so.choice), where)
        return Constraint(StructuredOutput.json_object(), where)
    except InvalidRequestError as exc:
        raise ApiError(400, f"{where}: {exc}", param=where) from exc


def warning_headers(warnings: tuple[str, ...], streams: Sequence[RequestStream] = ()) -> dict[str, str]:
    """``X-Agent-Infer-Warnings``: what the constraint's lowering ignored, each once (JSON list,
    ASCII-escaped): ``warnings`` found while building the request, and those the engine reported
    for each of ``streams`` (an unknown ``format`` or keyword, a keyword a lenient schema skipped)."""
    found = list(dict.fromkeys([*warnings, *(w for stream in streams for w in stream.warnings)]))
    return {"X-Agent-Infer-Warnings": json.dumps(found)} if found else {}


def resolve_max_tokens(value: int | None, field: str, limit: int) -> int:
    """``max_tokens`` checked against the server's limit (the limit itself when not given)."""
    if value is None:
        return limit
    if value > limit:
        raise ApiError(400, f"{field}={value} exceeds this server's limit of {limit}", param=field)
    return value


def build_sampling(
    req: ChatCompletionRequest | CompletionRequest,
    *,
    max_tokens: int,
    structured: StructuredOutput | None,
    logprobs: int | None,
    vocab_size: int,
) -> SamplingParams:
    """SamplingParams for the request; its validation errors become 400s naming the field."""
    bias = _logit_bias(req.logit_bias, vocab_size)
    try:
        return SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            max_tokens=max_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            seed=req.seed,
            logprobs=logprobs,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            structured=structured,
            close_on_length=bool(req.close_on_length),
            min_tokens=req.min_tokens or 0,
            logit_bias=bias,
            **_dry_fields(req),
            # SGLang's extensions (server/router_fields.py), sent by sglang-router.
            ignore_eos=bool(req.ignore_eos),
            include_stop_str_in_output=bool(req.no_stop_trim),
            skip_special_tokens=req.skip_special_tokens is not False,
        )
    except InvalidRequestError as exc:
        raise ApiError(400, str(exc), param=exc.field) from exc


def _dry_fields(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The ``dry_*``, ``value_close_*`` and ``speculative_*`` fields the request sets (the others keep
    SamplingParams' defaults)."""
    names = [f for f in type(req).model_fields if f.startswith(("dry_", "value_close_", "speculative_"))]
    return {name: getattr(req, name) for name in names if getattr(req, name) is not None}


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) with the ids checked against the vocabulary."""
    if not bias:
        return None
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdecimal() else -1
        if not 0 <= token < vocab_size:
            raise ApiError(
                400,
                f"logit_bias key {key!r} is not a token id in [0, {vocab_size})",
                param=f"logit_bias.{key}",
            )
        out[token] = value
    return out


def _token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _finite(value: float) -> float:
    # JSON has no -inf; a masked-out alternative is reported with the most negative double instead.
    return value if math.isfinite(value) else -9999.0


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], entries: list[dict[int, float]], top_n: int
) -> list[dict[str, Any]]:
    """``choices[].logprobs.content`` entries for the given tokens."""
    out = []
    for token_id, entry in zip(token_ids, entries):
        text = _token_text(tokenizer, token_id)
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        out.append(
            {
                "token": text,
                "logprob": _finite(entry.get(token_id, -math.inf)),
                "bytes": list(text.encode("utf-8")),
                "top_logprobs": [
                    {
                        "token": (t := _token_text(tokenizer, i)),
                        "logprob": _finite(lp),
                        "bytes": list(t.encode("utf-8")),
                    }
                    for i, lp in top
                ],
            }
        )
    return out


def completion_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], entries: list[dict[int, float]], top_n: int, offset: int
) -> dict[str, Any]:
    """``choices[].logprobs`` of a text completion (tokens, token_logprobs, top_logprobs, text_offset)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = _token_text(tokenizer, token_id)
        tokens.append(text)
        token_lps.append(_finite(entry.get(token_id, -math.inf)))
        top = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        tops.append({_token_text(tokenizer, i): _finite(lp) for i, lp in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
