"""Drive the paged forward pass for a handful of sequences without the engine.

Used by tests, benchmarks and debugging: it owns a small block pool and builds
:class:`AttentionMetadata` the way the engine's scheduler does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agent_infer.errors import EngineError
from agent_infer.model.families.base import CausalLM
from agent_infer.model.kv_cache import KVCache
from agent_infer.model.layers.attention import AttentionMetadata


class SequenceRunner:
    """Feed tokens of several sequences through one model and KV pool; returns last-token logits.

    Blocks are handed out from the top of the pool downwards so block tables are not simply
    ``0, 1, 2...``: this exercises the paging as the engine would.
    """

    def __init__(self, model: CausalLM, num_blocks: int = 64, block_size: int = 16) -> None:
        self.model = model
        self.block_size = block_size
        self.cache = KVCache.allocate(model.config, num_blocks, block_size, model.device, model.dtype)
        self._free = list(range(num_blocks))
        self._tables: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}

    def release(self, seq_id: int) -> None:
        """Forget a sequence and return its blocks to the pool."""
        self._free.extend(self._tables.pop(seq_id, []))
        self._lens.pop(seq_id, None)

    def step(self, batch: Sequence[tuple[int, Sequence[int]]]) -> torch.Tensor:
        """Append ``tokens`` to each ``(seq_id, tokens)`` and return float32 logits ``[B, vocab]`` of their last tokens."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        ctx_lens: list[int] = []
        tables: list[list[int]] = []
        bs = self.block_size
        for seq_id, tokens in batch:
            table = self._tables.setdefault(seq_id, [])
            start = self._lens.get(seq_id, 0)
            end = start + len(tokens)
            while len(table) * bs < end:
                if not self._free:
                    raise EngineError("SequenceRunner: KV block pool exhausted")
                table.append(self._free.pop())
            self._lens[seq_id] = end
            ids.extend(int(t) for t in tokens)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            qsl.append(len(ids))
            ctx_lens.append(end)
            tables.append(list(table))
        meta = AttentionMetadata(qsl, ctx_lens, tables, torch.tensor(slots, dtype=torch.int64), bs)
        last = [q - 1 for q in qsl[1:]]
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64), torch.tensor(positions), meta, self.cache, keep_rows=last
        )
        return self.model.compute_logits(hidden)

    def greedy(self, prompt: Sequence[int], max_new_tokens: int, seq_id: int = 0) -> list[int]:
        """Greedy-decode ``max_new_tokens`` tokens after ``prompt`` (prefill, then one token per step)."""
        out: list[int] = []
        logits = self.step([(seq_id, prompt)])
        for _ in range(max_new_tokens):
            nxt = int(logits[0].argmax())
            out.append(nxt)
            if len(out) == max_new_tokens:
                break
            logits = self.step([(seq_id, [nxt])])
        return out
