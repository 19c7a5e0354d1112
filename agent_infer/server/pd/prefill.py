"""The prefill side: run the prompt, keep its KV and first token under the room, serve the room.

A prefill request runs with ``max_tokens=1``. When the engine releases its blocks (on the engine
thread, before any later step can reuse them) the blocks covering the prompt are copied into one
staging buffer registered with the transfer engine, and the room becomes ready. The decode worker
reads the room's description from ``GET /pd/rooms/{room}`` (this server's own HTTP port is the
bootstrap port: ``--prefill http://host:PORT PORT``), reads the KV with the transfer engine, and
ends the room with ``DELETE /pd/rooms/{room}``.

A prefill this worker refuses (a 4xx for the request) or that fails is recorded under the room,
and the room request answers 409 with the prefill's status and message, so the decode worker
fails the request the same way at once instead of waiting for a room that never comes.

Limits: a room is kept at most ``ROOM_TTL_S`` seconds and at most ``MAX_ROOMS`` rooms at once
(the oldest is dropped first); a decode worker asking for a dropped room gets a 404
(``code: "room_not_found"``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.engine.sequence import Sequence
from agent_infer.sampling_params import SamplingParams
from agent_infer.server.errors import ApiError
from agent_infer.server.pd.transfer import Transfer, block_bytes_per_pool, kv_pools

#: Seconds a computed room waits for its decode worker.
ROOM_TTL_S = 120.0
#: Rooms held at once (each holds a prompt's KV in host memory).
MAX_ROOMS = 256
#: Longest a decode worker's room request waits for the prefill to finish.
MAX_WAIT_S = 60.0


def prompt_digest(token_ids: list[int]) -> str:
    """What both sides compare to be sure they rendered the same prompt."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()


@dataclass
class Room:
    """A finished prefill: its KV blocks in a staging buffer, its first token."""

    staging: torch.Tensor
    num_blocks: int
    num_prompt_tokens: int
    digest: str
    first_token: int
    created: float


class PrefillRole:
    """Holds prefilled rooms for decode workers; installs the engine's release hook."""

    mode = "prefill"

    def __init__(self, engine: LLMEngine, transfer: Transfer) -> None:
        self.engine = engine
        self.transfer = transfer
        self.block_bytes = block_bytes_per_pool(engine.runner.kv_cache)
        self._rooms_of: dict[str, int] = {}  # request id -> room
        self._rooms: OrderedDict[int, Room] = OrderedDict()
        # Rooms whose prefill was refused or failed: (HTTP status, message, when).
        self._failed: OrderedDict[int, tuple[int, str, float]] = OrderedDict()
        self._lock = threading.Lock()
        engine.block_manager.on_release = self._on_release

    def params(self, params: SamplingParams) -> SamplingParams:
        """A prefill computes the prompt and the first token only."""
        return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))

    def expect(self, request_id: str, room: int) -> None:
        """``request_id`` is the prefill of ``room``."""
        with self._lock:
            self._rooms_of[request_id] = room

    def fail(self, room: int, status: int, message: str) -> None:
        """The prefill of ``room`` was refused or failed: its decode worker learns at once."""
        with self._lock:
            self._failed[room] = (status, message, time.monotonic())
            while len(self._failed) > MAX_ROOMS:
                self._failed.popitem(last=False)

    def failure(self, room: int) -> tuple[int, str] | None:
        """Why the prefill of ``room`` failed, if it did."""
        with self._lock:
            found = self._failed.get(room)
        return None if found is None else (found[0], found[1])

    def forget(self, request_id: str) -> None:
        """The handler is done with ``request_id``: drop its room mapping if no release took it
        (a request that failed before it had blocks)."""
        with self._lock:
            self._rooms_of.pop(request_id, None)

    def _on_release(self, seq: Sequence) -> None:
        # Engine thread, inside the step that finished ``seq``: its blocks still hold the KV.
        with self._lock:
            room = self._rooms_of.pop(seq.request_id, None) if seq.is_finished else None
        if room is None:
            return
        if seq.num_output_tokens < 1 or seq.finish_reason not in ("stop", "length"):
            self.fail(room, 503, f"the prefill ended with finish reason {seq.finish_reason}")
            return
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        num_blocks = -(-len(prompt) // self.engine.block_manager.block_size)
        index = torch.tensor(seq.block_table[:num_blocks], dtype=torch.long)
        parts = [
            p.index_select(0, index).reshape(-1).view(torch.uint8)
            for p in kv_pools(self.engine.runner.kv_cache)
        ]
        staging = torch.cat(parts)
        self.transfer.register(staging)
        first = seq.token_ids[seq.num_prompt_tokens]
        entry = Room(staging, num_blocks, len(prompt), prompt_digest(prompt), first, time.monotonic())
        with self._lock:
            self._rooms[room] = entry
            self._expire_locked()

    def _expire_locked(self) -> None:
        now = time.monotonic()
        while self._rooms:
            room, entry = next(iter(self._rooms.items()))
            if len(self._rooms) <= MAX_ROOMS and now - entry.created < ROOM_TTL_S:
                return
            del self._rooms[room]
            self.transfer.unregister(entry.staging)

    def describe(self, room: int) -> dict[str, object] | None:
        """What a decode worker needs to read the room, or None while it is not ready."""
        with self._lock:
            self._expire_locked()
            entry = self._rooms.get(room)
        if entry is None:
            return None
        return {
            "session": self.transfer.endpoint.session,
            "address": entry.staging.data_ptr(),
            "block_bytes": self.block_bytes,
            "num_blocks": entry.num_blocks,
            "num_prompt_tokens": entry.num_prompt_tokens,
            "prompt_digest": entry.digest,
            "first_token": entry.first_token,
        }

    def end(self, room: int) -> bool:
        """Drop a room once its decode worker has read it."""
        with self._lock:
            entry = self._rooms.pop(room, None)
        if entry is not None:
            self.transfer.unregister(entry.staging)
        return entry is not None

    def install_routes(self, app: FastAPI) -> None:
        """The bootstrap endpoints decode workers call."""

        @app.get("/pd/rooms/{room}")
        async def describe_room(room: int, wait_s: float = 30.0) -> Response:
            deadline = time.monotonic() + min(max(wait_s, 0.0), MAX_WAIT_S)
            while (found := self.describe(room)) is None:
                failed = self.failure(room)
                if failed is not None:
                    return JSONResponse(
                        {
                            "error": {
                                "message": failed[1],
                                "prefill_status": failed[0],
                                "code": "prefill_failed",
                            }
                        },
                        status_code=409,
                    )
                if time.monotonic() >= deadline:
                    raise ApiError(
                        404, f"bootstrap room {room} is not ready or was dropped", code="room_not_found"
                    )
                await asyncio.sleep(0.005)
            return JSONResponse(found)

        @app.delete("/pd/rooms/{room}")
        async def end_room(room: int) -> Response:
            if not self.end(room):
                raise ApiError(404, f"bootstrap room {room} is not held here", code="room_not_found")
            return JSONResponse({"status": "ok"})
