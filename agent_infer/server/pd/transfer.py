"""Mooncake's transfer engine over TCP: registered KV memory on each side, reads by address.

``mooncake-transfer-engine-non-cuda`` (the ``cluster`` extra) runs its TCP transport on CPU-only
hosts; its native library links ``libibverbs.so.1`` (Debian: ``libibverbs1``), present or not
RDMA hardware. The peer is found by ``P2PHANDSHAKE`` (no metadata server): a session id is
``host:rpc_port``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import torch

from agent_infer.errors import ConfigError, EngineError
from agent_infer.model.kv_cache import KVCache

#: Most entries and bytes in one batched read.
_BATCH_ENTRIES = 1024
_BATCH_BYTES = 16 << 20


def kv_pools(kv_cache: KVCache) -> list[torch.Tensor]:
    """The per-layer pools in a fixed order (:meth:`KVCache.block_pools`)."""
    return kv_cache.block_pools()


def block_bytes_per_pool(kv_cache: KVCache) -> list[int]:
    """Bytes of one block in each pool (``kv_pools`` order)."""
    return [p[0].numel() * p.element_size() for p in kv_pools(kv_cache)]


@dataclass(frozen=True)
class Endpoint:
    """Where a transfer engine listens: the session id peers name it by."""

    session: str


class Transfer:
    """One process's Mooncake transfer engine (TCP), with memory registered once."""

    def __init__(self, host: str) -> None:
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise ConfigError(
                "prefill/decode disaggregation needs Mooncake's transfer engine: install the 'cluster' "
                f"extra (mooncake-transfer-engine-non-cuda) and libibverbs1 ({exc})"
            ) from exc
        self._engine: Any = TransferEngine()
        if self._engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise EngineError(f"Mooncake transfer engine failed to start on {host}")
        self.endpoint = Endpoint(f"{host}:{self._engine.get_rpc_port()}")
        self._lock = threading.Lock()

    def register(self, tensor: torch.Tensor) -> None:
        """Make ``tensor``'s memory readable by peers (and writable into by reads here)."""
        with self._lock:
            status = self._engine.register_memory(tensor.data_ptr(), tensor.numel() * tensor.element_size())
        if status != 0:
            raise EngineError(f"Mooncake could not register {tensor.numel() * tensor.element_size()} bytes")

    def unregister(self, tensor: torch.Tensor) -> None:
        """Forget a registration made with :meth:`register`."""
        with self._lock:
            self._engine.unregister_memory(tensor.data_ptr())

    def read(self, peer: str, local: list[int], remote: list[int], lengths: list[int]) -> int:
        """Copy ``lengths[i]`` bytes from the peer's ``remote[i]`` to local ``local[i]``; returns bytes."""
        start = 0
        while start < len(lengths):
            # Batches past ~2,000 entries or ~25 MB fail with status -1 (measured, 0.3.13 TCP).
            end, size = start, 0
            while end < len(lengths) and end - start < _BATCH_ENTRIES and size + lengths[end] <= _BATCH_BYTES:
                size += lengths[end]
                end += 1
            end = max(end, start + 1)
            with self._lock:
                status = self._engine.batch_transfer_sync_read(
                    peer, local[start:end], remote[start:end], lengths[start:end]
                )
            if status != 0:
                raise EngineError(
                    f"Mooncake read of {sum(lengths[start:end])} bytes from {peer} failed (status {status})"
                )
            start = end
        return sum(lengths)
