"""``POST /v1/completions``: one text (or token-id) prompt -> text, as JSON or SSE chunks."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from agent_infer.engine.output import RequestOutput
from agent_infer.server.params import (
    build_constraint,
    build_sampling,
    completion_logprobs,
    resolve_max_tokens,
)
from agent_infer.server.protocol import CompletionRequest
from agent_infer.server.responder import Responder
from agent_infer.server.router_fields import bootstrap_of
from agent_infer.server.state import ServerState
from agent_infer.server.streaming import Increment

# OpenAI's default for /v1/completions when max_tokens is not given.
_DEFAULT_MAX_TOKENS = 16


async def create_completion(state: ServerState, req: CompletionRequest, request: Request) -> Response:
    """Answer one text completion request (JSON or SSE)."""
    req.check_supported()
    state.check_model(req.model)
    prompt = _prompt(req.prompt)
    constraint = build_constraint(req)
    limit = state.config.max_tokens_limit
    max_tokens = resolve_max_tokens(req.max_tokens or min(_DEFAULT_MAX_TOKENS, limit), "max_tokens", limit)
    params = build_sampling(
        req,
        max_tokens=max_tokens,
        structured=constraint.structured,
        logprobs=req.logprobs,
        vocab_size=state.engine.engine.vocab_size,
    )
    responder = _TextResponder(state, state.new_id("cmpl"), req.logprobs)
    responder.bootstrap = bootstrap_of(req)
    return await responder.respond(req, request, prompt, params, constraint.field, constraint.warnings)


def _prompt(prompt: str | list[str] | list[int]) -> str | list[int]:
    """The one prompt: text, a one-element list of text, or token ids."""
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], str):
        return str(prompt[0])
    return [int(t) for t in prompt]


class _TextResponder(Responder):
    """Text choices: the whole ``text``, or its increments (logprobs offsets count streamed text)."""

    body_object = "text_completion"
    chunk_object = "text_completion"
    chunk_fingerprint = False

    def __init__(self, state: ServerState, request_id: str, top_logprobs: int | None) -> None:
        super().__init__(state, request_id)
        self._top_logprobs = top_logprobs
        self._offset = 0

    def fork(self) -> _TextResponder:
        """Another choice's responder (its own logprobs text offset)."""
        return _TextResponder(self.state, self.request_id, self._top_logprobs)

    def choice(self, output: RequestOutput) -> dict[str, Any]:
        """The generated text and its finish reason."""
        completion = output.outputs[0]
        logprobs = None
        if self._top_logprobs is not None and completion.logprobs is not None:
            logprobs = completion_logprobs(
                self.state.tokenizer, completion.token_ids, completion.logprobs, self._top_logprobs, 0
            )
        return {"text": completion.text, "logprobs": logprobs, "finish_reason": completion.finish_reason}

    def increment(self, step: Increment, output: RequestOutput) -> list[dict[str, Any]]:
        """The new text (with its logprobs), when there is any."""
        logprobs = None
        if self._top_logprobs is not None and step.token_ids:
            logprobs = completion_logprobs(
                self.state.tokenizer, step.token_ids, step.logprobs, self._top_logprobs, self._offset
            )
        self._offset += len(step.text)
        if not step.text and logprobs is None:
            return []
        return [{"text": step.text, "logprobs": logprobs, "finish_reason": None}]

    def finish(self, reason: str | None) -> dict[str, Any]:
        """Empty text with the finish reason."""
        return {"text": "", "logprobs": None, "finish_reason": reason}
