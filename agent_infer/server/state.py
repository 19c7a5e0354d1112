"""What every handler shares: the async engine, settings, model identity and the request lifecycle."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from agent_infer.engine.llm_engine import Prompt
from agent_infer.engine.output import RequestOutput
from agent_infer.errors import EngineError, InvalidRequestError
from agent_infer.model.tokenizer import Tokenizer
from agent_infer.sampling_params import SamplingParams
from agent_infer.server.async_engine import AsyncEngine, EngineStoppedError, RequestStream
from agent_infer.server.config import ServerConfig
from agent_infer.server.errors import ApiError, finish_error, request_error
from agent_infer.server.metrics import ServerMetrics
from agent_infer.server.prompts import PromptTokenizer
from agent_infer.server.response_store import ResponseStore
from agent_infer.server.router_fields import Bootstrap
from agent_infer.tool_formats import ToolCallFormat


class ClientGoneError(ApiError):
    """The client disconnected before its answer was ready (the request was aborted)."""

    def __init__(self) -> None:
        super().__init__(499, "client disconnected", code="client_closed_request")


@dataclass
class ServerState:
    """The running server's shared objects."""

    engine: AsyncEngine
    config: ServerConfig
    model_name: str
    tokenizer: Tokenizer
    tool_format: ToolCallFormat
    metrics: ServerMetrics
    prompts: PromptTokenizer
    responses: ResponseStore = field(default_factory=ResponseStore)
    created: int = field(default_factory=lambda: int(time.time()))
    active: set[str] = field(default_factory=set)
    #: This server's half of prefill/decode disaggregation (``server/pd/``), if it has one.
    pd: Any = None

    def check_model(self, model: str) -> None:
        """404 unless ``model`` is the served model's id."""
        if model != self.model_name:
            raise ApiError(
                404,
                f"model {model!r} is not served here; available: {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    @staticmethod
    def new_id(prefix: str) -> str:
        """A fresh response id."""
        return f"{prefix}-{uuid.uuid4().hex}"

    async def submit(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        constraint_field: str | None,
        bootstrap: Bootstrap | None = None,
    ) -> RequestStream:
        """Queue a request in the engine; rejections become 400s naming the field. With
        ``bootstrap`` (sglang-router's PD mode) it is this server's half of a prefill/decode pair."""
        prompt_field = (
            "prompt"
            if isinstance(prompt, str) or not prompt or not isinstance(prompt[0], dict)
            else "messages"
        )
        if bootstrap is not None:
            try:
                token_ids = await self.prompts.token_ids(prompt, prompt_field)
                return await self._submit_pd(request_id, token_ids, params, constraint_field, bootstrap)
            except ApiError as exc:
                if self.pd is not None and self.pd.mode == "prefill":
                    self.pd.fail(bootstrap.room, exc.status, exc.message)
                raise
        token_ids = await self.prompts.token_ids(prompt, prompt_field)
        try:
            stream = await self.engine.add(request_id, token_ids, params)
        except InvalidRequestError as exc:
            error = request_error(exc, constraint_field)
            if error.param == "prompt":
                error.param = prompt_field
            raise error from exc
        except EngineStoppedError as exc:
            raise ApiError(503, str(exc), code="engine_stopped") from exc
        stream.constraint_field = constraint_field
        self.active.add(request_id)
        return stream

    async def _submit_pd(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        constraint_field: str | None,
        bootstrap: Bootstrap,
    ) -> RequestStream:
        if self.pd is None:
            raise ApiError(
                400,
                "bootstrap fields are only accepted by prefill/decode workers; this server colocates "
                "prefill and decode (start it with --disaggregation-mode, or run the router without "
                "--pd-disaggregation)",
                param="bootstrap_room",
                code="not_a_pd_worker",
            )
        if params.structured is not None:
            raise ApiError(
                400,
                "structured outputs and tools are not served across a prefill/decode pair",
                param=constraint_field,
                code="not_served_disaggregated",
            )
        try:
            if self.pd.mode == "prefill":
                self.pd.expect(request_id, bootstrap.room)
                stream = await self.engine.add(request_id, token_ids, self.pd.params(params))
            else:
                meta = await self.pd.room(bootstrap, token_ids)
                stream = await self.engine.add_prefilled(
                    request_id, token_ids, params, int(meta["first_token"]), self.pd.loader(meta)
                )
                await self.pd.end(bootstrap)
        except InvalidRequestError as exc:
            raise request_error(exc, constraint_field) from exc
        except EngineStoppedError as exc:
            raise ApiError(503, str(exc), code="engine_stopped") from exc
        except EngineError as exc:  # the decode pool is full now, or the KV read failed
            raise ApiError(503, str(exc), code="pd_handoff_failed") from exc
        stream.constraint_field = constraint_field
        self.active.add(request_id)
        return stream

    def release(self, request_id: str, finished: bool) -> None:
        """The handler is done with a request: abort it in the engine unless it finished.

        Idempotent: aborting a request the engine has already finished or forgotten does nothing.
        """
        self.active.discard(request_id)
        if not finished:
            self.engine.abort(request_id)
        if self.pd is not None and self.pd.mode == "prefill":
            self.pd.forget(request_id)

    async def first_output(self, stream: RequestStream, request: Request) -> RequestOutput:
        """The first snapshot (a failure before it is still an HTTP error, not a 200 stream)."""
        output = await self._until(stream.next(), stream, request)
        if output.finish_reason == "error":
            self.release(stream.request_id, True)
            raise finish_error(output.outputs[0].error, stream.constraint_field)
        return output

    async def final_output(self, stream: RequestStream, request: Request) -> RequestOutput:
        """The finished output, aborting the request if the client disconnects first."""
        output = await self._until(stream.final(), stream, request)
        self.release(stream.request_id, True)
        if output.finish_reason == "error":
            raise finish_error(output.outputs[0].error, stream.constraint_field)
        if output.finish_reason == "abort":
            raise ApiError(503, "the request was aborted (server shutting down)", code="aborted")
        return output

    async def final_outputs(self, streams: list[RequestStream], request: Request) -> list[RequestOutput]:
        """The finished outputs of a request's choices; if one fails, every choice is aborted."""
        if len(streams) == 1:
            return [await self.final_output(streams[0], request)]
        try:
            return list(await asyncio.gather(*(self.final_output(s, request) for s in streams)))
        except BaseException:
            for stream in streams:
                self.release(stream.request_id, False)
            raise

    async def _until(
        self, work: Coroutine[Any, Any, RequestOutput], stream: RequestStream, request: Request
    ) -> RequestOutput:
        task = asyncio.ensure_future(work)
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            watcher.cancel()
            self.release(stream.request_id, False)
            raise
        watcher.cancel()
        if task not in done:
            task.cancel()
            self.release(stream.request_id, False)
            raise ClientGoneError()
        try:
            return task.result()
        except EngineStoppedError as exc:
            self.release(stream.request_id, False)
            raise ApiError(503, str(exc), code="engine_stopped") from exc
        except BaseException:
            self.release(stream.request_id, False)
            raise


async def _disconnected(request: Request) -> None:
    """Returns once the client has gone (the body has been read, so only disconnects arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
