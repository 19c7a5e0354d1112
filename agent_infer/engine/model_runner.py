"""Runs the model on a scheduled batch: packs tokens, builds attention metadata, returns logits."""

from __future__ import annotations

from collections.abc import Callable

import torch

from agent_infer.accelerator import Accelerator
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.scheduler import ScheduledSequence
from agent_infer.engine.sequence import Sequence
from agent_infer.errors import ConfigError
from agent_infer.model.kv_cache import KVCache
from agent_infer.model.layers.attention import AttentionMetadata
from agent_infer.model.loader import LoadedModel


class ModelRunner:
    """Owns the model and its paged KV cache; one :meth:`run` call is one forward pass."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        accelerator: Accelerator,
        extra_bytes_per_token: int = 0,
    ) -> None:
        """``extra_bytes_per_token``: cache bytes a draft module adds per token slot (MTP), counted
        against ``kv_cache_memory_bytes`` when sizing the pool."""
        self.model = loaded.model
        self.extra_bytes_per_token = extra_bytes_per_token
        #: Sequences whose hidden rows a step keeps (MTP drafting); None: none.
        self.keep_hidden: Callable[[Sequence], bool] | None = None
        #: Per such sequence of the last run: the first fed position and the hidden rows it fed.
        self.hidden: dict[Sequence, tuple[int, torch.Tensor]] = {}
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
        per_block += self.extra_bytes_per_token * config.block_size
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
        keep = self.keep_hidden
        self.hidden = {}
        kept: list[tuple[Sequence, int, int, int]] = []  # seq, first position, first row, end row
        for item in batch:
            seq = item.seq
            start = item.start
            table = seq.block_table
            if item.num_new_tokens == 1 and not item.draft:
                # A plain decode item, most of a decode step's batch: one token, no slicing.
                end = start + 1
                input_ids.append(seq.token_ids[start])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                end = start + item.num_new_tokens
                input_ids.extend(seq.token_ids[start:end])
                input_ids.extend(item.draft)
                end += len(item.draft)
                positions.extend(range(start, end))
                slots.extend([table[pos // bs] * bs + pos % bs for pos in range(start, end)])
            if keep is not None and keep(seq):
                kept.append((seq, item.start, query_start_loc[-1], len(input_ids)))
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
            keep_rows=None if kept else sample_rows,
        )
        if kept:
            for seq, first, lo, hi in kept:
                self.hidden[seq] = (first, hidden[lo:hi])
            hidden = hidden.index_select(
                0, torch.tensor(sample_rows, dtype=torch.int64, device=hidden.device)
            )
        if not sample_rows:
            return None
        if allowed is not None and self.masked_head:
            return self.model.compute_logits(hidden, allowed())
        return self.model.compute_logits(hidden)
