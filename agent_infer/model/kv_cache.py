"""The paged KV cache: per layer, K and V pools of fixed-size blocks that the engine hands out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent_infer.errors import ConfigError
from agent_infer.model.config import ModelConfig


@dataclass
class KVCache:
    """Per-layer K and V tensors shaped ``[num_blocks, block_size, num_kv_heads, head_dim]``.

    A token's KV slot is ``block_id * block_size + offset``; the engine's block manager owns the
    mapping from sequences to blocks, the model only reads and writes slots.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    num_blocks: int
    block_size: int

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> KVCache:
        """Allocate zeroed K/V pools for every layer of ``config``."""
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(
                f"KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        return cls(k=k, v=v, num_blocks=num_blocks, block_size=block_size)

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, K and V together (to size the pool)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem

    @property
    def num_slots(self) -> int:
        """Total token slots in the pool."""
        return self.num_blocks * self.block_size

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V viewed as ``[num_slots, num_kv_heads, head_dim]``."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, k.shape[2], k.shape[3]), v.view(-1, v.shape[2], v.shape[3])
