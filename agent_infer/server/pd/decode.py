"""The decode side: fetch the room from the prefill worker, read its KV, decode without prefill.

The room's description (``GET /pd/rooms/{room}`` on ``bootstrap_host:bootstrap_port``) names the
prefill worker's transfer session, the staging buffer's address and its block layout. The decode
worker checks that it rendered the same prompt (a digest of the token ids) and has the same KV
layout, then, on its engine thread, allocates blocks for the request, reads the blocks its own
prefix cache does not already hold (one read per pool and block, batched) and queues the request
as decoding from the prefill's first token.

Bytes read per request: ``(ceil(n / block_size) - c) * block_size * bytes_per_token``, ``n`` the
prompt tokens, ``c`` the full blocks already cached here, ``bytes_per_token`` the KV layout's
(``2 * layers * kv_heads * head_dim * dtype bytes`` for K/V).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import httpx

from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.server.errors import ApiError
from agent_infer.server.pd.prefill import MAX_WAIT_S, prompt_digest
from agent_infer.server.pd.transfer import Transfer, block_bytes_per_pool, kv_pools
from agent_infer.server.router_fields import Bootstrap


class DecodeRole:
    """Reads prefilled KV from prefill workers into this engine's pool."""

    mode = "decode"

    def __init__(self, engine: LLMEngine, transfer: Transfer) -> None:
        self.engine = engine
        self.transfer = transfer
        self.pools = kv_pools(engine.runner.kv_cache)
        self.block_bytes = block_bytes_per_pool(engine.runner.kv_cache)
        for pool in self.pools:
            transfer.register(pool)
        self._lock = threading.Lock()
        #: KV bytes read from prefill workers, and the requests they came with.
        self.bytes_received = 0
        self.requests_received = 0

    async def room(self, bootstrap: Bootstrap, token_ids: list[int]) -> dict[str, Any]:
        """The room's description, checked against this worker's prompt and layout (502 otherwise)."""
        url = f"http://{bootstrap.host}:{bootstrap.port}/pd/rooms/{bootstrap.room}"
        try:
            async with httpx.AsyncClient(timeout=MAX_WAIT_S + 10) as client:
                resp = await client.get(url, params={"wait_s": MAX_WAIT_S})
        except httpx.HTTPError as exc:
            raise ApiError(
                502, f"prefill worker at {url} unreachable: {exc}", code="pd_bootstrap_failed"
            ) from exc
        if resp.status_code == 409:
            failed = resp.json()["error"]
            raise ApiError(
                int(failed["prefill_status"]),
                f"the prefill worker failed this request: {failed['message']}",
                code="pd_prefill_failed",
            )
        if resp.status_code != 200:
            raise ApiError(
                502,
                f"prefill worker answered {resp.status_code} for {url}: {resp.text[:200]}",
                code="pd_bootstrap_failed",
            )
        meta: dict[str, Any] = resp.json()
        if meta["num_prompt_tokens"] != len(token_ids) or meta["prompt_digest"] != prompt_digest(token_ids):
            raise ApiError(
                502,
                f"the prefill worker's prompt ({meta['num_prompt_tokens']} tokens) differs from this worker's "
                f"({len(token_ids)}): the two must serve the same model and chat template",
                code="pd_prompt_mismatch",
            )
        if meta["block_bytes"] != self.block_bytes:
            raise ApiError(
                502, "the prefill worker's KV layout differs from this worker's", code="pd_layout_mismatch"
            )
        return meta

    def loader(self, meta: dict[str, Any]) -> Callable[[list[int], int], int]:
        """On the engine thread: read blocks ``start..`` of the room into ``block_table``'s blocks."""

        def load(block_table: list[int], start: int) -> int:
            local: list[int] = []
            remote: list[int] = []
            lengths: list[int] = []
            offset = meta["address"]
            num_blocks = meta["num_blocks"]
            for pool, size in zip(self.pools, self.block_bytes):
                for j in range(start, num_blocks):
                    local.append(pool.data_ptr() + block_table[j] * size)
                    remote.append(offset + j * size)
                    lengths.append(size)
                offset += num_blocks * size
            moved = self.transfer.read(meta["session"], local, remote, lengths)
            with self._lock:
                self.bytes_received += moved
                self.requests_received += 1
            return moved

        return load

    def metrics_text(self) -> str:
        """Prometheus lines of the KV read from prefill workers."""
        with self._lock:
            moved, requests = self.bytes_received, self.requests_received
        return (
            "# HELP agent_infer_pd_kv_bytes_received_total KV bytes read from prefill workers.\n"
            "# TYPE agent_infer_pd_kv_bytes_received_total counter\n"
            f"agent_infer_pd_kv_bytes_received_total {moved}\n"
            "# HELP agent_infer_pd_requests_received_total Requests decoded from a prefill worker's KV.\n"
            "# TYPE agent_infer_pd_requests_received_total counter\n"
            f"agent_infer_pd_requests_received_total {requests}\n"
        )

    async def end(self, bootstrap: Bootstrap) -> None:
        """Tell the prefill worker the room was read (its staging memory is freed)."""
        url = f"http://{bootstrap.host}:{bootstrap.port}/pd/rooms/{bootstrap.room}"
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                await client.delete(url)
        except httpx.HTTPError:
            pass  # the prefill worker drops unclaimed rooms after ROOM_TTL_S anyway
