"""Prompts are rendered and tokenized on a worker thread, never on the engine thread.

The engine thread runs every request's steps; a prompt tokenized there (the engine's
``add_request`` does it for text and chat prompts) would stall every stream for as long as it
takes, seconds for a prompt of megabytes. Here the handler renders and tokenizes off both the event
loop and the engine thread, and hands the engine token ids. A prompt whose UTF-8 size alone proves
it cannot fit the context is rejected before any tokenizing: no token of this vocabulary spells
more than ``max_token_bytes`` bytes, so the text needs at least ``bytes / max_token_bytes`` tokens.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.errors import InvalidRequestError, PromptTooLongError, TokenizerError
from agent_infer.server.errors import ApiError


class PromptTokenizer:
    """Turns a request's prompt (text, token ids or chat messages) into token ids for the engine."""

    def __init__(self, engine: LLMEngine) -> None:
        self._tokenizer = engine.tokenizer
        self._max_model_len = engine.max_model_len
        # The byte-level (or byte-fallback) spelling of a token is never shorter than the bytes it
        # stands for, so this bounds the bytes one token can cover.
        tok = self._tokenizer
        self.max_token_bytes = max(
            (len((tok.token_str(i) or "").encode("utf-8")) for i in range(tok.vocab_size)), default=1
        )

    async def token_ids(self, prompt: str | list[int] | list[dict[str, Any]], field: str) -> list[int]:
        """The prompt's token ids; a prompt that cannot fit or does not render is a 400 naming ``field``."""
        if not isinstance(prompt, str) and all(isinstance(t, int) for t in prompt):
            return [t for t in prompt if isinstance(t, int)]
        try:
            return await asyncio.to_thread(self._encode, cast("str | list[dict[str, Any]]", prompt))
        except InvalidRequestError as exc:
            raise ApiError(400, str(exc), param=field) from exc
        except TokenizerError as exc:  # the chat template refused the transcript (e.g. role order)
            raise ApiError(400, str(exc), param=field, code="chat_template") from exc

    def _encode(self, prompt: str | list[dict[str, Any]]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", field="prompt")
            self._check_size(prompt)
            return self._tokenizer.encode(prompt, add_special_tokens=True)
        text = self._tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
        self._check_size(text)
        return self._tokenizer.encode(text, add_special_tokens=False)

    def _check_size(self, text: str) -> None:
        size = len(text.encode("utf-8", "surrogatepass"))
        at_least = -(-size // self.max_token_bytes)
        if at_least + 1 > self._max_model_len:
            raise PromptTooLongError(
                f"prompt of {size} bytes needs at least {at_least} tokens; with at least one generated"
                f" token it exceeds the context of {self._max_model_len} tokens",
                field="prompt",
            )
