"""The worker endpoints sglang-router calls besides the OpenAI API.

Found by running sglang-router 0.3.2 against a logging server: at registration it reads
``/server_info`` (falling back to ``/get_server_info``) and ``/model_info`` (falling back to
``/get_model_info``); ``power_of_two`` polls ``GET /get_load`` and takes the sum of
``num_tokens`` over the list it returns (SGLang's per-DP-rank shape; any other shape reads as
load -1); the router's ``POST /flush_cache`` fans out to every worker's ``POST /flush_cache``;
health checks are ``GET /health``.

The info bodies carry ``served_model_name`` (the router's model id for this worker) and no
``model_path``/``tokenizer_path``: given a path, the router tries to fetch a tokenizer for it
from a model hub, which this server never needs (it routes HTTP requests by their text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, params
from fastapi.responses import JSONResponse, Response

from agent_infer import __version__
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.server.errors import ApiError
from agent_infer.server.state import ServerState

#: Routes served here, for the request counter's endpoint label.
WORKER_ENDPOINTS = (
    "/server_info",
    "/get_server_info",
    "/model_info",
    "/get_model_info",
    "/get_load",
    "/flush_cache",
)


def _flush(engine: LLMEngine) -> int | None:
    """On the engine thread: drop the cached prefixes, unless requests are in flight (None)."""
    if engine.has_unfinished_requests():
        return None
    return engine.block_manager.reset_prefix_cache()


def install_worker_routes(app: FastAPI, state: ServerState, guarded: Sequence[params.Depends]) -> None:
    """Add the sglang-router worker endpoints to ``app``."""
    engine = state.engine.engine
    blocks = engine.block_manager

    def server_info() -> dict[str, Any]:
        return {
            "served_model_name": state.model_name,
            "engine": "agent-infer",
            "version": __version__,
            "context_length": engine.max_model_len,
            "max_total_num_tokens": blocks.num_blocks * blocks.block_size,
            "page_size": blocks.block_size,
            "kv_bytes_per_token": engine.runner.kv_bytes_per_token,
            "max_running_requests": engine.config.max_num_seqs,
            "dp_size": 1,
            "tp_size": 1,
            "disaggregation_mode": state.config.disaggregation_mode,
        }

    def model_info() -> dict[str, Any]:
        return {
            "served_model_name": state.model_name,
            "is_generation": True,
            "max_model_len": engine.max_model_len,
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info_route() -> Response:
        return JSONResponse(server_info())

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info_route() -> Response:
        return JSONResponse(model_info())

    @app.get("/get_load")
    async def load() -> Response:
        snap = state.engine.snapshot
        used_tokens = (snap.kv_blocks_total - snap.kv_blocks_free) * blocks.block_size
        return JSONResponse(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": snap.running,
                    "num_waiting_reqs": snap.waiting + snap.waiting_for_grammar,
                    "num_tokens": used_tokens,
                }
            ]
        )

    @app.post("/flush_cache", dependencies=list(guarded))
    async def flush_cache() -> Response:
        dropped = await state.engine.call(_flush)
        if dropped is None:
            raise ApiError(
                409,
                "requests are in flight; the prefix cache is flushed only when the server is idle",
                code="server_busy",
            )
        return JSONResponse({"status": "ok", "flushed_blocks": dropped})
