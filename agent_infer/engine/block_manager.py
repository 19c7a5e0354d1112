"""Paged KV-cache bookkeeping: a pool of fixed-size blocks with prefix caching.

A full block is identified by a hash chain (the parent block's hash plus this block's token ids),
so two sequences sharing a prefix share the same physical blocks. A block is registered in the
prefix table only after its KV has actually been computed: registering at allocation time would let
a second sequence read KV that a chunked prefill has not written yet.

Freed blocks keep their hash and go to the back of an LRU free list, so a later request with the
same prefix can revive them until the pool needs the space.

When every layer attends only over a sliding window of W positions (Mistral; a Gemma 3 config whose
layers are all local), a running sequence's leading blocks that lie entirely before ``p - W + 1``,
``p`` being the next position it computes, are read by no later query: they are released as it
advances (``release_behind_window``), so a long generation holds about ``W / block_size + 2`` blocks.
Their table entries stay as stale ids that attention never reads (it gathers only the window). Released
blocks keep their hash like any freed block, so a new request with the same prefix can still revive
them; with prefix caching on, the last published block of the sequence is kept, because the next
block's hash chains from it. Interleaved local/global models (Gemma 3) release nothing: their global
layers read every block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

from agent_infer.engine.sequence import Sequence
from agent_infer.errors import EngineError

if TYPE_CHECKING:
    from agent_infer.engine.kv_tier import HostKVTier

_NO_HASH = -1


class Block:
    """One physical KV block: its reference count and (once full and computed) its content hash."""

    __slots__ = ("block_id", "hash", "ref_count", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash = _NO_HASH
        self.token_ids: tuple[int, ...] = ()

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_count}, hashed={self.hash != _NO_HASH})"


def window_of_every_layer(sliding_window: int | None, layer_types: Seq[str]) -> int | None:
    """The window bounding every layer's attention (``None`` when some layer attends to all positions).

    ``layer_types`` as in ``ModelConfig`` (empty: every layer takes ``sliding_window``).
    """
    if sliding_window is None:
        return None
    if any(t != "sliding_attention" for t in layer_types):
        return None
    return sliding_window


def block_hash(token_ids: tuple[int, ...], parent_hash: int) -> int:
    """Hash of a full block given its tokens and the hash of the block before it (-1 for the first)."""
    return hash((parent_hash, token_ids))


class BlockManager:
    """Allocates KV blocks to sequences, shares identical prefixes, and frees on completion."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        *,
        sliding_window: int | None = None,
    ) -> None:
        """``sliding_window``: the window bounding every layer (see :func:`window_of_every_layer`);
        set, blocks behind it are released as sequences advance."""
        if num_blocks <= 0 or block_size <= 0:
            raise EngineError(f"KV pool needs positive sizes, got {num_blocks} blocks of {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise EngineError(f"sliding_window must be >= 1, got {sliding_window}")
        self.sliding_window = sliding_window
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.hash_to_block: dict[int, int] = {}
        # Insertion order is eviction order: the least recently freed block is reused first.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_prefix_hits = 0
        self.num_prefix_queries = 0
        #: The second KV tier (engine/kv_tier.py): evicted prefix blocks go there and come back.
        self.tier: HostKVTier | None = None
        #: Called with a sequence just before its blocks are released, while they still hold its
        #: KV (prefill/decode disaggregation stages a finished prefill's blocks here).
        self.on_release: Callable[[Sequence], None] | None = None

    # --- metrics ---------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no owner (some may still hold a reusable cached prefix)."""
        return len(self.free_block_ids)

    @property
    def usage(self) -> float:
        """Fraction of the pool owned by live sequences, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks required to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    # --- allocation --------------------------------------------------------------------------------

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids whose content equals ``seq``'s leading full blocks, stopping at the first miss.

        The last token is never served from cache: the model must run on at least one token to
        produce logits for the next one.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        parent = _NO_HASH
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for i in range(max_blocks):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(tokens, parent)
            block_id = self.hash_to_block.get(h)
            # Comparing tokens guards against hash collisions, which would silently corrupt output.
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether the pool can hold all of ``seq``'s current tokens right now."""
        hits = self._cached_prefix(seq)
        shared = sum(1 for b in hits if self.blocks[b].ref_count > 0)
        return self.blocks_needed(seq.num_tokens) - shared <= self.num_free_blocks

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens, reusing cached prefix blocks.

        Sets ``seq.num_computed_tokens`` to the number of tokens whose KV was found in the cache.
        """
        if seq.block_table:
            raise EngineError(f"sequence {seq.request_id!r} already holds blocks")
        if not self.can_allocate(seq):
            raise EngineError(f"not enough free KV blocks for sequence {seq.request_id!r}")
        hits = self._cached_prefix(seq)
        self.num_prefix_queries += 1
        for block_id in hits:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_block_ids[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        cached = len(hits)
        if self.tier is not None and self.enable_prefix_caching:
            cached += self._restore_from_tier(seq, hits)
        self.num_prefix_hits += bool(cached)
        seq.num_computed_tokens = cached * self.block_size
        seq.num_hashed_blocks = cached
        for _ in range(self.blocks_needed(seq.num_tokens) - cached):
            seq.block_table.append(self._take_free_block())

    def _restore_from_tier(self, seq: Sequence, hits: list[int]) -> int:
        """Continue ``seq``'s prefix walk past the device hits in the tier; returns blocks found.

        Each restored block takes a fresh device block (counted in ``can_allocate``'s need, as a
        miss would be), gets the tier's KV and is registered like a computed block.
        """
        assert self.tier is not None
        parent = self.blocks[hits[-1]].hash if hits else _NO_HASH
        restored = 0
        for i in range(len(hits), (seq.num_tokens - 1) // self.block_size):
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = block_hash(tokens, parent)
            on_device = self.hash_to_block.get(h)
            if on_device is not None and self.blocks[on_device].token_ids == tokens:
                # Past a block the device had lost, the rest of the prefix may still be there.
                block = self.blocks[on_device]
                if block.ref_count == 0:
                    del self.free_block_ids[on_device]
                block.ref_count += 1
                seq.block_table.append(on_device)
                parent = h
                restored += 1
                continue
            if not self.tier.claim(h, tokens):
                break
            block_id = self._take_free_block()
            if not self.tier.restore(h, block_id):
                self.blocks[block_id].ref_count = 0
                self.free_block_ids[block_id] = None
                self.free_block_ids.move_to_end(block_id, last=False)
                break
            block = self.blocks[block_id]
            block.hash = h
            block.token_ids = tokens
            self.hash_to_block.setdefault(h, block_id)
            seq.block_table.append(block_id)
            parent = h
            restored += 1
        return restored

    def _take_free_block(self) -> int:
        block_id, _ = self.free_block_ids.popitem(last=False)
        block = self.blocks[block_id]
        # The block's old content is about to be overwritten, so its prefix entry must go.
        if block.hash != _NO_HASH:
            if self.tier is not None:
                self.tier.offload(block_id, block.hash, block.token_ids)
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
        block.hash = _NO_HASH
        block.token_ids = ()
        block.ref_count = 1
        return block_id

    def can_append(self, seq: Sequence, extra: int = 0) -> bool:
        """Whether the blocks ``seq`` needs for its current tokens (plus ``extra`` draft tokens) are available."""
        return self.blocks_needed(seq.num_tokens + extra) - len(seq.block_table) <= self.num_free_blocks

    def append(self, seq: Sequence, extra: int = 0) -> None:
        """Grow ``seq``'s block table to cover its current tokens plus ``extra`` draft tokens
        (usually one new block or none). Blocks a rejected draft reached stay with ``seq``."""
        missing = self.blocks_needed(seq.num_tokens + extra) - len(seq.block_table)
        if missing > self.num_free_blocks:
            raise EngineError(f"not enough free KV blocks to extend sequence {seq.request_id!r}")
        for _ in range(missing):
            seq.block_table.append(self._take_free_block())

    def deallocate(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks; blocks nobody else uses go to the free list, keeping their hash."""
        if self.on_release is not None:
            self.on_release(seq)
        # Reversed so that a prefix's tail is evicted before its head, which other prompts share more.
        # Entries before num_released_blocks were released behind the sliding window already.
        for block_id in reversed(seq.block_table[seq.num_released_blocks :]):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block_id] = None
        seq.block_table.clear()
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0
        seq.num_released_blocks = 0

    def release_behind_window(self, seq: Sequence) -> int:
        """Release ``seq``'s leading blocks that no query at or after its next position can attend to
        (a no-op without a window bounding every layer). Returns how many blocks were released."""
        window = self.sliding_window
        if window is None:
            return 0
        # the next query sits at num_computed_tokens and sees keys from there minus window - 1 on
        upto = max(0, seq.num_computed_tokens - window + 1) // self.block_size
        if self.enable_prefix_caching:
            upto = min(upto, seq.num_hashed_blocks - 1)
        upto = min(upto, len(seq.block_table))
        start = seq.num_released_blocks
        for i in range(start, upto):
            block = self.blocks[seq.block_table[i]]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_block_ids[block.block_id] = None
        seq.num_released_blocks = max(start, upto)
        return max(0, upto - start)

    def num_held_blocks(self, seq: Sequence) -> int:
        """Blocks ``seq`` holds now (its table minus the entries released behind the window)."""
        return len(seq.block_table) - seq.num_released_blocks

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix of blocks no sequence owns; returns how many were dropped.

        Blocks in use keep their entries (their sequences still read them).
        """
        dropped = 0
        for block_id in self.free_block_ids:
            block = self.blocks[block_id]
            if block.hash == _NO_HASH:
                continue
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
                dropped += 1
            block.hash = _NO_HASH
            block.token_ids = ()
        if self.tier is not None:
            dropped += self.tier.clear()
        return dropped

    # --- prefix registration -----------------------------------------------------------------------

    def register_computed(self, seq: Sequence) -> None:
        """Publish ``seq``'s fully computed blocks to the prefix table (call after each model step)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        start = seq.num_hashed_blocks
        # Only new blocks are hashed, so per-step cost does not grow with the sequence length.
        parent = self.blocks[seq.block_table[start - 1]].hash if start > 0 else _NO_HASH
        for i in range(start, num_full):
            block = self.blocks[seq.block_table[i]]
            if block.hash != _NO_HASH:
                parent = block.hash
                continue
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            block.hash = block_hash(tokens, parent)
            block.token_ids = tokens
            # First writer wins: a duplicate computed concurrently stays private to its sequence.
            self.hash_to_block.setdefault(block.hash, block.block_id)
            parent = block.hash
        seq.num_hashed_blocks = max(start, num_full)
