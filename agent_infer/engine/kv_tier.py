"""A second KV tier: evicted prefix blocks kept in bounded host memory and restored on a prefix hit.

The device pool keeps freed blocks with their hash (``BlockManager``) until the pool needs the
space; without a tier, reusing such a block loses its KV and a later request with that prefix
recomputes it. With a tier, the block manager hands the block's KV to :meth:`HostKVTier.offload`
just before reuse, and :meth:`HostKVTier.restore` copies it into a fresh device block when a
later prefix walk reaches that hash, so the tokens count as computed (and as cached tokens).

Agents resend the same system prompt and tool schemas every turn; once more of them are active
than the device pool holds, the tier turns their recomputation into copies.

Storage is one preallocated host buffer per device pool (pinned where the device is CUDA), with
``capacity_blocks`` slots; the least recently used entry is dropped when a new one needs a slot.
Entries are matched by hash and compared token by token, as in the device prefix table. The tier
is inclusive: a restored entry stays, so a prefix evicted again later costs no second copy.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from agent_infer.errors import ConfigError
from agent_infer.model.kv_cache import KVCache


@dataclass
class TierStats:
    """What the tier did: blocks written to it, restored from it, and dropped for space."""

    offloaded: int = 0
    restored: int = 0
    dropped: int = 0
    lookups: int = 0


class HostKVTier:
    """Bounded LRU of KV blocks in host memory, keyed by the device prefix table's block hash."""

    def __init__(self, kv_cache: KVCache, capacity_bytes: int) -> None:
        self._pools = kv_cache.block_pools()
        self.block_bytes = sum(p[0].numel() * p.element_size() for p in self._pools)
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int):
            raise ConfigError(f"host_kv_cache_bytes must be an int, got {capacity_bytes!r}")
        self.capacity_blocks = capacity_bytes // self.block_bytes
        if self.capacity_blocks < 1:
            raise ConfigError(
                f"host_kv_cache_bytes={capacity_bytes} is smaller than one KV block ({self.block_bytes} bytes)"
            )
        pin = self._pools[0].device.type == "cuda"
        self._host = [
            torch.empty((self.capacity_blocks, *p.shape[1:]), dtype=p.dtype, pin_memory=pin)
            for p in self._pools
        ]
        # hash -> (slot, token ids); insertion order is recency (the first entry is dropped first).
        self._entries: OrderedDict[int, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._free_slots = list(range(self.capacity_blocks - 1, -1, -1))
        self.stats = TierStats()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def capacity_bytes(self) -> int:
        """Bytes the host buffers take."""
        return self.capacity_blocks * self.block_bytes

    def offload(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Copy device block ``block_id`` (about to be reused) into the tier under ``block_hash``."""
        if block_hash in self._entries:
            self._entries.move_to_end(block_hash)
            return
        if not self._free_slots:
            _, (slot, _) = self._entries.popitem(last=False)
            self._free_slots.append(slot)
            self.stats.dropped += 1
        slot = self._free_slots.pop()
        for host, pool in zip(self._host, self._pools):
            host[slot].copy_(pool[block_id], non_blocking=True)
        self._entries[block_hash] = (slot, token_ids)
        self.stats.offloaded += 1

    def claim(self, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Whether the tier holds this block; if so it becomes the most recently used entry, so
        the offload that making room for its restore may cause does not drop it."""
        self.stats.lookups += 1
        entry = self._entries.get(block_hash)
        if entry is None or entry[1] != token_ids:
            return False
        self._entries.move_to_end(block_hash)
        return True

    def restore(self, block_hash: int, block_id: int) -> bool:
        """Copy the entry into device block ``block_id``; False if it is gone (then nothing is written)."""
        entry = self._entries.get(block_hash)
        if entry is None:
            return False
        slot = entry[0]
        for host, pool in zip(self._host, self._pools):
            pool[block_id].copy_(host[slot], non_blocking=True)
        self.stats.restored += 1
        return True

    def clear(self) -> int:
        """Drop every entry; returns how many there were."""
        count = len(self._entries)
        self._entries.clear()
        self._free_slots = list(range(self.capacity_blocks - 1, -1, -1))
        return count
