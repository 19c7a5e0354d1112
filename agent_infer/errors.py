"""The one exception root of agent-infer and its typed children.

Error contract (stated once, relied on everywhere):

* Every error raised on purpose by agent-infer derives from :class:`AgentInferError`.
* An error names the problem *and where it is*: a JSON pointer for schemas (``pointer``), a line and
  column for grammar text (``line``/``column``), a character offset for regexes (``position``), a field
  name for request parameters (``field``).
* Bad input never crashes, hangs, or silently drops a constraint: resource limits (grammar size,
  compile time, per-step work) raise :class:`GrammarLimitError` instead.
* A failing request fails alone; the engine keeps serving the others.
"""

from __future__ import annotations

import warnings as _warnings


class AgentInferError(Exception):
    """Root of every error agent-infer raises on purpose."""


# --- configuration and environment -------------------------------------------------------------


class ConfigError(AgentInferError, ValueError):
    """A configuration value (argument or ``AGENT_INFER_*`` variable) is invalid."""


class AcceleratorUnavailableError(AgentInferError, RuntimeError):
    """The requested accelerator's runtime is not present on this machine."""


class NativeExtensionMissingError(AgentInferError, ImportError):
    """The C++ extension ``agent_infer._native`` is not built or failed to import."""


# --- models --------------------------------------------------------------------------------------


class ModelLoadError(AgentInferError, RuntimeError):
    """A model file or directory could not be loaded (corrupt, truncated, missing tensor, unsupported)."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """No model exists at the given location; the message says how to install one."""


class UnsupportedModelError(ModelLoadError):
    """The model uses an architecture or quantization type agent-infer does not implement."""


# --- requests and the engine ---------------------------------------------------------------------


class InvalidRequestError(AgentInferError, ValueError):
    """A request or its sampling parameters are invalid. ``field`` names the offending parameter."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one generated token) does not fit in the model's context."""


class EngineError(AgentInferError, RuntimeError):
    """The engine could not complete a request for a reason other than the request's input."""


class ClientClosedError(EngineError):
    """A local client's call ended because the client was closed while it ran, or was refused
    because the client is closed to new calls (the interpreter is exiting)."""


class RankFailedError(EngineError):
    """A rank process of a data/expert-parallel engine died or failed; ``rank`` names it. The
    engine is unhealthy from then on: the rank's requests (every rank's, under expert parallelism)
    fail with this error and new requests are refused."""

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


# --- grammars ------------------------------------------------------------------------------------


class GrammarError(AgentInferError, ValueError):
    """Root of grammar and constraint errors."""


class GrammarSyntaxError(GrammarError):
    """Grammar text (GBNF, Lark, regex) does not parse. Carries ``line``/``column`` (1-based) or ``position``."""

    def __init__(
        self,
        message: str,
        *,
        line: int | None = None,
        column: int | None = None,
        position: int | None = None,
    ) -> None:
        where = []
        if line is not None:
            where.append(f"line {line}")
        if column is not None:
            where.append(f"column {column}")
        if position is not None and line is None:
            where.append(f"position {position}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.line = line
        self.column = column
        self.position = position


class UnsupportedRegexError(GrammarSyntaxError):
    """A regex uses a construct that cannot be compiled to a grammar (lookaround, backreference)."""


class GrammarDefinitionError(GrammarError):
    """A grammar is well-formed text but not a valid grammar (undefined rule, no root, empty language)."""


class InvalidSchemaError(GrammarError):
    """A JSON Schema is not valid JSON Schema. ``pointer`` is the JSON pointer of the problem."""

    def __init__(self, message: str, *, pointer: str = "") -> None:
        super().__init__(f"{message} (at {pointer or '/'})")
        self.pointer = pointer


class UnsupportedSchemaError(GrammarError):
    """Strict mode met a keyword the compiler cannot enforce. Carries ``keyword`` and ``pointer``."""

    def __init__(self, message: str, *, keyword: str, pointer: str = "") -> None:
        super().__init__(f"{message} (keyword {keyword!r} at {pointer or '/'})")
        self.keyword = keyword
        self.pointer = pointer


class GrammarLimitError(GrammarError):
    """A resource limit was hit (grammar size, lexer/automaton states, compile time, per-step work)."""


class TokenBitmaskError(GrammarError):
    """A token bitmask does not fit the logits it is applied to, or cannot be filled (shape, dtype,
    device, row indices, read-only memory)."""


class MatcherUsageError(GrammarError, TypeError):
    """A grammar matcher got an argument it cannot take (a token id outside the vocabulary, a
    rollback past the start, text that is not valid Unicode, an object of the wrong type).
    ``argument`` names the offending argument when one is to blame."""

    def __init__(self, message: str, *, argument: str | None = None) -> None:
        super().__init__(f"{message} (argument {argument!r})" if argument else message)
        self.argument = argument


class MatcherBusyError(GrammarError, RuntimeError):
    """A grammar matcher was called while another call on it, from another thread, was still running.

    A matcher serves one thread at a time; ``operation`` is the refused call and ``running`` the
    one in progress (``fill_next_token_bitmask_batch`` while the matcher is in a batch fill).
    """

    def __init__(self, message: str, *, operation: str = "", running: str = "") -> None:
        super().__init__(message)
        self.operation = operation
        self.running = running


class TokenizerError(AgentInferError, ValueError):
    """A tokenizer could not be read or is of an unsupported kind."""


# --- the client, tools and agents ----------------------------------------------------------------


class ValidationRetryError(AgentInferError):
    """Every attempt's output failed validation (Pydantic validators beyond the schema, or truncation).

    ``attempts`` is how many outputs were tried, ``raw_outputs`` their texts and ``errors`` the
    validation error text of each, in order.
    """

    def __init__(self, message: str, *, raw_outputs: list[str], errors: list[str]) -> None:
        lines = [message, *(f"  attempt {i + 1}: {e}" for i, e in enumerate(errors))]
        super().__init__("\n".join(lines))
        self.attempts = len(raw_outputs)
        self.raw_outputs = raw_outputs
        self.errors = errors


class MaxTurnsExceeded(AgentInferError):
    """An agent run reached ``max_turns`` without a final answer.

    ``transcript`` has every message, ``usage`` the tokens and requests the run spent (a client
    ``Usage``).
    """

    def __init__(
        self,
        message: str,
        *,
        transcript: list[dict[str, object]],
        max_turns: int,
        usage: object = None,
    ) -> None:
        super().__init__(message)
        self.transcript = transcript
        self.max_turns = max_turns
        self.usage = usage


class UsageLimitExceeded(AgentInferError):
    """An agent run hit one of its usage limits.

    ``limit`` names it (``max_requests``, ``max_total_tokens``, ``max_tool_calls``), ``value`` is
    its bound, ``usage`` what the run had spent and ``transcript`` every message so far.
    """

    def __init__(
        self, message: str, *, limit: str, value: int, usage: object, transcript: list[dict[str, object]]
    ) -> None:
        super().__init__(f"{message} ({limit}={value})")
        self.limit = limit
        self.value = value
        self.usage = usage
        self.transcript = transcript


class ToolCallError(AgentInferError):
    """A tool call could not be completed (the tool kept asking for corrections, or the reply was unusable).

    ``tool`` names the tool, ``arguments`` are the last arguments the model sent.
    """

    def __init__(self, message: str, *, tool: str, arguments: object = None) -> None:
        super().__init__(f"{message} (tool {tool!r})")
        self.tool = tool
        self.arguments = arguments


class IncompleteToolCallError(ToolCallError):
    """The model's output ran out of ``max_tokens`` inside a tool call, so the call cannot be made.

    ``tool`` names the tool when its name was written before the cut (else None), ``raw_output`` is
    the whole output, ``tool_calls`` the calls that were complete (OpenAI-shaped) and
    ``max_tokens`` the budget that ran out.
    """

    def __init__(
        self,
        message: str,
        *,
        tool: str | None,
        raw_output: str,
        tool_calls: list[dict[str, object]],
        max_tokens: int,
    ) -> None:
        AgentInferError.__init__(self, f"{message} (tool {tool!r})" if tool else message)
        self.tool = tool  # type: ignore[assignment]  # None: the cut came before the name
        self.arguments = None
        self.raw_output = raw_output
        self.tool_calls = tool_calls
        self.max_tokens = max_tokens


class RemoteError(AgentInferError):
    """A remote OpenAI-compatible server answered with an error (or not at all: ``status`` 0).

    ``status`` is the HTTP status, ``body`` the response text (or the transport error).
    """

    def __init__(self, message: str, *, status: int, body: str) -> None:
        super().__init__(f"{message} (HTTP {status}): {body[:500]}")
        self.status = status
        self.body = body


# --- warnings ------------------------------------------------------------------------------------


class ConstraintWarning(UserWarning):
    """A constraint compiled but its lowering ignored part of it: an unknown ``format`` value or
    keyword (a JSON Schema annotation), or, with ``strict=False``, a keyword it cannot enforce.
    The message lists each with its JSON pointer (``Grammar.warnings``)."""


def warn_constraint(warnings: tuple[str, ...] | list[str], what: str, stacklevel: int = 3) -> None:
    """Issue one :class:`ConstraintWarning` listing ``warnings`` (nothing when there are none)."""
    if warnings:
        _warnings.warn(f"{what}: {'; '.join(warnings)}", ConstraintWarning, stacklevel=stacklevel)
