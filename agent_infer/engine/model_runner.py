"""Runs the model on a scheduled batch: packs tokens, builds attention metadata, returns logits."""

from __future__ import annotations

from collections.abc import Callable

import torch

from agent_infer.accelerator import Accelerator
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.scheduler import ScheduledSequence
from agent_infer.errors import ConfigError
from agent_infer.model.kv_cache import KVCache
from agent_infer.model.layers.attention import AttentionMetadata
from agent_infer.model.loader import LoadedModel


class ModelRunner:
    """Owns the model and its paged KV cache; one :meth:`run` call is one forward pass."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig, accelerator: Accelerator) -> None:
        self.model = loaded.model
        self.model_config = loaded.config
        self.device = accelerator.device
        self.block_size = config.block_size
        # Only a head that skips masked-out tokens gains from waiting for the mask before the projection.
        self.masked_head = config.masked_head and self.model.masked_head
        #: KV cache bytes one token takes across all layers (the latent layout's size for MLA models;
        #: a fraction for the compressed layout, whose entries are shared by several tokens).
        per_block = KVCache.bytes_per_block(self.model_config, config.block_size, config.torch_dtype)
        self.kv_bytes_per_token: int | float = (
            per_block // config.block_size
            if per_block % config.block_size == 0
            else per_block / config.block_size
        )
        self.num_blocks = self._num_blocks(config)
        self.kv_cache = KVCache.allocate(
            self.model_config, self.num_blocks, self.block_size, self.device, config.torch_dtype
        )

    def _num_blocks(self, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = KVCache.bytes_per_block(self.model_config, config.block_size, config.torch_dtype)
        num_blocks = config.kv_cache_memory_bytes // per_block
        if num_blocks < 1:
            raise ConfigError(
                f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} is smaller than one KV block "
                f"({per_block} bytes)"
            )
        return int(num_blocks)

    @torch.inference_mode()
    def run(
        self, batch: list[ScheduledSequence], allowed: Callable[[], torch.Tensor] | None = None
    ) -> torch.Tensor | None:
        """Forward ``batch``; return float32 logits for the items that sample, in order: one row
        each, plus one row per draft token of items with a draft.

        ``allowed`` returns the step's token bitmask (one row per logits row, unconstrained rows
        all ones); it is called after the decoder layers, so a fill overlapped with them is
        joined only then, and the output projection skips tokens no row allows (those logits
        are ``-inf``; the caller masks anyway). Returns None when no item samples.
        """
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_rows: list[int] = []
        for item in batch:
            seq = item.seq
            end = item.start + item.num_new_tokens
            input_ids.extend(seq.token_ids[item.start : end])
            input_ids.extend(item.draft)
            end += len(item.draft)
            table = seq.block_table
            for pos in range(item.start, end):
                positions.append(pos)
                slots.append(table[pos // bs] * bs + pos % bs)
            query_start_loc.append(len(input_ids))
            context_lens.append(end)
            block_tables.append(table)
            if item.samples:
                # The last chunk token's row, then one row per draft token (verification).
                sample_rows.extend(range(len(input_ids) - 1 - len(item.draft), len(input_ids)))

        device = self.device
        meta = AttentionMetadata(
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            block_tables=block_tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            block_size=bs,
        )
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            meta,
            self.kv_cache,
            keep_rows=sample_rows,
        )
        if not sample_rows:
            return None
        if allowed is not None and self.masked_head:
            return self.model.compute_logits(hidden, allowed())
        return self.model.compute_logits(hidden)
