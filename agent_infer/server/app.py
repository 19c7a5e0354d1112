"""The FastAPI application: routes, API-key check, body limit, error shapes and engine lifecycle."""

from __future__ import annotations

import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent_infer import envs
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.gc_heap import freeze_startup_heap
from agent_infer.server.async_engine import AsyncEngine
from agent_infer.server.body import read_json
from agent_infer.server.chat import create_chat_completion
from agent_infer.server.completions import create_completion
from agent_infer.server.config import ServerConfig
from agent_infer.server.errors import ApiError
from agent_infer.server.metrics import ServerMetrics
from agent_infer.server.pd.decode import DecodeRole
from agent_infer.server.pd.roles import make_pd_role
from agent_infer.server.prompts import PromptTokenizer
from agent_infer.server.protocol import ChatCompletionRequest, CompletionRequest
from agent_infer.server.responses import ResponsesRequest, create_response
from agent_infer.server.state import ServerState
from agent_infer.server.tokenize import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from agent_infer.server.worker_routes import WORKER_ENDPOINTS, install_worker_routes
from agent_infer.tool_formats import detect_format, get_format

logger = logging.getLogger(__name__)


def served_name(engine: LLMEngine) -> str:
    """The default model id: the model file's (or folder's) name without a ``.gguf`` suffix."""
    path = Path(engine.loaded.path)
    return path.stem if path.suffix == ".gguf" else path.name


def create_app(engine: LLMEngine, config: ServerConfig | None = None) -> FastAPI:
    """An app serving ``engine``; the engine thread starts and stops with the app's lifespan."""
    config = config or ServerConfig()
    metrics = ServerMetrics()
    tokenizer = engine.tokenizer
    fmt = get_format(config.tool_format) if config.tool_format else detect_format(tokenizer.chat_template)
    state = ServerState(
        engine=AsyncEngine(engine, metrics),
        config=config,
        model_name=config.model_name or served_name(engine),
        tokenizer=tokenizer,
        tool_format=fmt,
        metrics=metrics,
        prompts=PromptTokenizer(engine),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if envs.gc_freeze():
            # Everything the engine loaded lives as long as the server: full collections that
            # re-read it would land on requests (see agent_infer/gc_heap.py).
            freeze_startup_heap()
        state.engine.start()
        try:
            yield
        finally:
            state.engine.stop()

    app = FastAPI(title="agent-infer", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = state
    if config.disaggregation_mode != "null":
        state.pd = make_pd_role(config.disaggregation_mode, engine, config.host)
        if config.disaggregation_mode == "prefill":
            state.pd.install_routes(app)
    _install_error_handlers(app)

    async def require_key(request: Request) -> None:
        if config.api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        # compare_digest takes time independent of where the strings differ.
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), config.api_key.encode()):
            raise ApiError(
                401,
                "missing or wrong API key (send 'Authorization: Bearer <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    guarded = [Depends(require_key)]

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if not getattr(state.engine.engine, "healthy", True):  # a data-parallel engine lost a rank
            return JSONResponse({"status": "engine unhealthy"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        text = metrics.render(state.engine.snapshot, len(state.active))
        if isinstance(state.pd, DecodeRole):
            text += state.pd.metrics_text()
        extra = getattr(state.engine.engine, "prometheus_lines", None)  # data-parallel engines
        if extra is not None:
            text = text.rstrip("\n") + "\n" + "\n".join(extra()) + "\n"
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    def model_card() -> dict[str, object]:
        return {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "agent-infer",
            "max_model_len": engine.max_model_len,
        }

    @app.get("/v1/models", dependencies=guarded)
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    # ``:path``: model ids may contain slashes (``org/name``), as in OpenAI and vLLM.
    @app.get("/v1/models/{model_id:path}", dependencies=guarded)
    async def model(model_id: str) -> Response:
        state.check_model(model_id)
        return JSONResponse(model_card())

    install_worker_routes(app, state, guarded)

    @app.post("/v1/responses", dependencies=guarded)
    async def responses(request: Request) -> Response:
        body = await read_json(request, ResponsesRequest, config.max_body_bytes)
        return await create_response(state, body, request)

    @app.get("/v1/responses/{response_id}", dependencies=guarded)
    async def stored_response(response_id: str) -> Response:
        return JSONResponse(state.responses.get(response_id, "response_id")[0])

    @app.post("/tokenize", dependencies=guarded)
    async def tokenize_route(request: Request) -> Response:
        body = await read_json(request, TokenizeRequest, config.max_body_bytes)
        return JSONResponse(await tokenize(state, body))

    @app.post("/detokenize", dependencies=guarded)
    async def detokenize_route(request: Request) -> Response:
        body = await read_json(request, DetokenizeRequest, config.max_body_bytes)
        return JSONResponse(await detokenize(state, body))

    @app.post("/v1/chat/completions", dependencies=guarded)
    async def chat(request: Request) -> Response:
        body = await read_json(request, ChatCompletionRequest, config.max_body_bytes)
        return await create_chat_completion(state, body, request)

    @app.post("/v1/completions", dependencies=guarded)
    async def completions(request: Request) -> Response:
        body = await read_json(request, CompletionRequest, config.max_body_bytes)
        return await create_completion(state, body, request)

    app.add_middleware(_CountRequests, metrics=metrics)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        body = ApiError(exc.status_code, str(exc.detail)).body()
        # Routing errors carry headers of their own (405: Allow).
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    async def validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        loc = ".".join(str(p) for p in first.get("loc", ()))
        return JSONResponse(ApiError(400, f"{loc}: {first.get('msg')}", param=loc).body(), status_code=400)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation)


class _CountRequests:
    """ASGI wrapper counting responses by route and status, and answering unexpected errors.

    An exception no handler took becomes a logged 500 in OpenAI's shape here, inside the count.
    It is not re-raised: Starlette's outermost middleware would re-raise it to uvicorn, which
    then closes the keep-alive connection under the client's next request. An exception after
    the response started cannot be answered any more; it propagates, so the connection closes
    and the client sees a truncated response rather than a complete-looking wrong one.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else "other"

        started = False

        async def counted(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.observe_request(endpoint, int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception as exc:
            if started:
                raise
            logger.exception("unhandled error in %s %s", scope.get("method", ""), path, exc_info=exc)
            error = ApiError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error")
            await JSONResponse(error.body(), status_code=500)(scope, receive, counted)


_ENDPOINTS = frozenset(
    {
        "/health",
        "/metrics",
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/tokenize",
        "/detokenize",
        *WORKER_ENDPOINTS,
    }
)


def serve(
    model: str | None = None,
    config: ServerConfig | None = None,
    engine_config: EngineConfig | None = None,
    engine: LLMEngine | None = None,
) -> None:
    """Load ``model`` (or serve ``engine``, e.g. a data-parallel one), build the app and run it with
    uvicorn until interrupted."""
    import uvicorn

    config = config or ServerConfig()
    engine = engine if engine is not None else LLMEngine(model, engine_config)
    app = create_app(engine, config)
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level="info", timeout_graceful_shutdown=5)
    finally:
        # The engine is ours alone here, so its compile pool and fill thread can go with the server.
        engine.grammar.shutdown()
