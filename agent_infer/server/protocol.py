"""Request bodies of the OpenAI-compatible API as Pydantic models.

Every model forbids unknown keys, and bodies are validated in strict JSON mode (no ``"0.5"`` for a
number, no ``true`` for an integer), so a misspelt or unsupported field is a 400 naming it instead
of being silently ignored. Fields OpenAI defines but this server cannot honour are declared so that
their *values* can be checked (``check_supported``): the neutral value passes, anything else is
rejected by name.

Integers are bounded to 64-bit signed values (OpenAI's range for ``seed``; torch's seeds and
token tensors are 64-bit), so an oversized number is a 400 naming its field rather than an
overflow deeper in.
Floats must be finite. OpenAI fields that change nothing in this server's output (``store``,
``metadata``, ``service_tier``, ``reasoning_effort``, ...) are declared, type-checked and then
ignored (listed in ``IGNORED_FIELDS``); fields whose values would change the output are honoured
or rejected by value.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agent_infer.sampling_params import MAX_SPECULATIVE_TOKENS
from agent_infer.server.errors import ApiError
from agent_infer.server.router_fields import check_router_fields

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

#: Any request integer: a 64-bit signed value.
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
#: Most choices (``n``) one request may ask for: each is an engine request of its own.
MAX_N = 16

#: A count (token limits, choices): at least 1, at most the 64-bit maximum.
Count = Annotated[int, Field(ge=1, le=INT64_MAX)]
#: A token id: non-negative and 64-bit (the engine checks it against the vocabulary).
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]

#: Chat fields accepted and ignored: they steer OpenAI's storage, routing, billing or reasoning
#: models, none of which exists here, and no value of theirs changes what this server generates.
IGNORED_FIELDS = (
    "store",
    "metadata",
    "service_tier",
    "reasoning_effort",
    "verbosity",
    "prompt_cache_key",
    "prompt_cache_options",
    "prompt_cache_retention",
    "safety_identifier",
    "user",
    "prediction",
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)


class ContentPart(_Strict):
    """A content part. Only ``text`` parts are served; the other kinds OpenAI defines are declared so
    that they are rejected as unsupported (by ``check_supported``) rather than as unknown fields."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None


class ToolCallFunction(_Strict):
    """The function half of an assistant tool call echoed back in the transcript."""

    name: str
    arguments: str


class ToolCallIn(_Strict):
    """An assistant tool call in the transcript."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    """One transcript message. ``refusal``/``annotations``/``audio``/``function_call`` are accepted
    because clients echo assistant messages back verbatim; only their empty values are. An
    assistant's ``reasoning_content`` (echoed by DeepSeek-style clients) is accepted and left out
    of the prompt, as reasoning APIs drop earlier turns' reasoning."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    refusal: None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None
    reasoning_content: str | None = None


class FunctionSpec(_Strict):
    """A function tool's definition."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(_Strict):
    """A tool entry of ``tools``."""

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(_Strict):
    """The function named by a forced ``tool_choice``."""

    name: str


class NamedToolChoice(_Strict):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaSpec(_Strict):
    """``response_format.json_schema``: ``strict: false`` lets unenforceable keywords be skipped;
    ``unknown_formats`` / ``unknown_keywords`` (extensions, default ``"ignore"``): ``"error"``
    refuses a schema with an unknown ``format`` value / keyword instead of ignoring it; ``numbers``
    (extension, default ``"float64"``): ``"exact"`` lifts the float64 digit limit on numbers."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None
    unknown_formats: Literal["ignore", "error"] | None = None
    unknown_keywords: Literal["ignore", "error"] | None = None
    numbers: Literal["float64", "exact"] | None = None

    def frontend_options(self) -> dict[str, str]:
        """The JSON Schema front-end options the request sets (``Grammar.from_json_schema``'s)."""
        return {
            name: value
            for name, value in (
                ("unknown_formats", self.unknown_formats),
                ("unknown_keywords", self.unknown_keywords),
                ("numbers", self.numbers),
            )
            if value is not None
        }


class ResponseFormat(_Strict):
    """``response_format``: text, any JSON object, or a JSON Schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(_Strict):
    """vLLM-style ``structured_outputs``: exactly one constraint."""

    json_: dict[str, Any] | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


class PredictionSpec(_Strict):
    """``prediction``: predicted output (a latency hint in OpenAI; accepted and ignored here)."""

    type: Literal["content"]
    content: str | list[ContentPart]


class StreamOptions(_Strict):
    """``stream_options``: a final usage chunk when ``include_usage``. ``include_obfuscation``
    (random padding against length side channels) is accepted and ignored: nothing is padded."""

    include_usage: bool = False
    include_obfuscation: bool | None = None


class _CommonRequest(_Strict):
    """Fields shared by chat and text completions."""

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    max_tokens: Count | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: Int64 | None = None
    n: Count | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    # vLLM extensions: multiplicative repetition penalty; close the document at max_tokens.
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    close_on_length: bool | None = None
    min_tokens: int | None = Field(default=None, ge=0, le=INT64_MAX)
    logit_bias: dict[str, float] | None = None
    # llama.cpp's DRY penalty (engine/dry.py); SamplingParams checks the values, naming the field.
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = Field(default=None, ge=1, le=INT64_MAX)
    dry_sequence_breakers: list[str] | None = None
    dry_penalty_last_n: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    dry_skip_whitespace: bool | None = None
    # Loop control inside one JSON value (engine/value_loops.py), checked like the dry_* fields.
    value_close_multiplier: float | None = None
    value_close_allowed: int | None = Field(default=None, ge=0, le=INT64_MAX)
    value_close_budget: float | None = None
    value_close_budget_bias: float | None = None
    # Speculative decoding per request (engine/speculator.py); SamplingParams checks the values.
    speculative_source: str | None = None
    speculative_tokens: int | None = Field(default=None, ge=0, le=MAX_SPECULATIVE_TOKENS)
    speculative_confidence: float | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # SGLang's extensions, sent by sglang-router on every request (server/router_fields.py).
    ignore_eos: bool | None = None
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    return_hidden_states: bool | None = None
    bootstrap_host: str | None = None
    bootstrap_port: int | None = Field(default=None, ge=0, le=65535)
    bootstrap_room: int | None = Field(default=None, ge=0, le=2**64 - 1)

    def check_common(self) -> None:
        """Reject values this server cannot honour, naming the field."""
        if self.n is not None and self.n > MAX_N:
            raise ApiError(400, f"n={self.n} exceeds this server's limit of {MAX_N} choices", param="n")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
        check_router_fields(self)


class ChatCompletionRequest(_CommonRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Accepted and ignored (IGNORED_FIELDS): nothing here stores, routes, bills or reasons.
    store: bool | None = None
    metadata: dict[str, str] | None = None
    # Strings, not OpenAI's current literals: any tier or effort is ignored alike, and a value
    # added later must not turn into a 400.
    service_tier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    prediction: PredictionSpec | None = None
    # Honoured where they match what this server does (text out), rejected by value otherwise.
    modalities: list[str] | None = None
    audio: Any = None
    web_search_options: Any = None
    moderation: Any = None
    functions: Any = None
    function_call: Any = None
    # SGLang's chat extensions (server/router_fields.py).
    continue_final_message: bool | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None

    def check_supported(self) -> None:
        """Reject values this server cannot honour, naming the field."""
        self.check_common()
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise ApiError(
                400,
                f"modalities {self.modalities} are unsupported: this server outputs text",
                param="modalities",
            )
        for name, why in (
            ("audio", "audio output is unsupported"),
            ("web_search_options", "web search is unsupported"),
            ("moderation", "moderation is unsupported: nothing here screens input or output"),
            ("functions", "the deprecated functions field is unsupported; send tools"),
            ("function_call", "the deprecated function_call field is unsupported; send tool_choice"),
        ):
            if getattr(self, name) is not None:
                raise ApiError(400, why, param=name)
        seen: dict[str, int] = {}
        for i, tool in enumerate(self.tools or []):
            name = tool.function.name
            if name in seen:
                raise ApiError(
                    400,
                    f"duplicate tool name {name!r} (tools.{seen[name]} and tools.{i}): tool names must be unique",
                    param=f"tools.{i}.function.name",
                    code="duplicate_tool_name",
                )
            seen[name] = i
        for i, message in enumerate(self.messages):
            if message.reasoning_content is not None and message.role != "assistant":
                raise ApiError(
                    400,
                    f"reasoning_content is only accepted on assistant messages, not {message.role!r}",
                    param=f"messages.{i}.reasoning_content",
                )
            for j, part in enumerate(message.content if isinstance(message.content, list) else []):
                if part.type != "text" or part.text is None:
                    raise ApiError(
                        400,
                        f"content part type {part.type!r} is unsupported: this model reads text parts only",
                        param=f"messages.{i}.content.{j}",
                    )
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens disagree; give one", param="max_tokens")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")


class CompletionRequest(_CommonRequest):
    """``POST /v1/completions`` (one prompt per request)."""

    prompt: str | list[str] | list[TokenId]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool | None = None
    suffix: str | None = None
    best_of: Count | None = None

    def check_supported(self) -> None:
        """Reject values this server cannot honour, naming the field."""
        self.check_common()
        if self.echo:
            raise ApiError(400, "echo=true is unsupported", param="echo")
        if self.suffix:
            raise ApiError(400, "suffix is unsupported", param="suffix")
        if self.best_of not in (None, 1):
            raise ApiError(400, f"best_of={self.best_of} is unsupported", param="best_of")
        texts = isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], str)
        if texts and len(self.prompt) != 1:
            raise ApiError(
                400, "a list of several prompts is unsupported; send one per request", param="prompt"
            )
