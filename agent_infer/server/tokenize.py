"""``POST /tokenize`` and ``POST /detokenize`` in vLLM's shapes (text or chat messages <-> token ids)."""

from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field

from agent_infer.server.chat import render_messages
from agent_infer.server.errors import ApiError
from agent_infer.server.protocol import ChatMessage, TokenId, ToolSpec, _Strict
from agent_infer.server.state import ServerState


class TokenizeRequest(_Strict):
    """Either ``prompt`` (text) or ``messages`` (rendered with the chat template, tools included)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolSpec] | None = None
    add_generation_prompt: bool = True
    # vLLM's defaults: a text prompt gets the BOS token, a rendered chat already holds its specials.
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """Token ids to text."""

    model: str | None = None
    tokens: list[TokenId]


async def tokenize(state: ServerState, req: TokenizeRequest) -> dict[str, Any]:
    """``{"count", "max_model_len", "tokens", "token_strs"}``; a bad request is a 400 naming the field."""
    if req.model is not None:
        state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "give exactly one of prompt and messages", param="prompt")
    if req.tools is not None and req.messages is None:
        raise ApiError(400, "tools are only rendered with messages", param="tools")
    tokenizer = state.tokenizer
    if req.prompt is not None:
        text, special = req.prompt, req.add_special_tokens is not False
    else:
        assert req.messages is not None
        messages = render_messages(state, req.messages, req.tools or [])
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
        except ValueError as exc:  # TokenizerError: the template refused the transcript
            raise ApiError(400, str(exc), param="messages", code="chat_template") from exc
        special = bool(req.add_special_tokens)
    ids = await asyncio.to_thread(tokenizer.encode, text, special)
    out: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": state.engine.engine.max_model_len,
        "tokens": ids,
        "token_strs": None,
    }
    if req.return_token_strs:
        out["token_strs"] = [tokenizer.token_str(i) for i in ids]
    return out


async def detokenize(state: ServerState, req: DetokenizeRequest) -> dict[str, Any]:
    """``{"prompt": text}``; an id outside the vocabulary is a 400 naming its position."""
    if req.model is not None:
        state.check_model(req.model)
    vocab = state.engine.engine.vocab_size
    for i, token in enumerate(req.tokens):
        if token >= vocab:
            raise ApiError(400, f"token {token} is not an id in [0, {vocab})", param=f"tokens.{i}")
    text = await asyncio.to_thread(state.tokenizer.decode, req.tokens, False)
    return {"prompt": text}
