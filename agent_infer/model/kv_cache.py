"""The paged KV cache: per layer, pools of fixed-size blocks that the engine hands out.

Two layouts share the block addressing (a token's slot is ``block_id * block_size + offset``):
``"kv"`` holds K and V pools ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer;
``"latent"`` (latent-attention models, :class:`~agent_infer.model.config.MLASpec`) holds one pool
``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` per layer: each token's normalized kv
latent and its rotated shared RoPE key, from which the attention layer expands or absorbs K and V.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from agent_infer.errors import ConfigError
from agent_infer.model.config import ModelConfig


@dataclass
class KVCache:
    """Per-layer cache pools in one of two layouts (see the module docstring).

    A token's slot is ``block_id * block_size + offset``; the engine's block manager owns the
    mapping from sequences to blocks, the model only reads and writes slots.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    num_blocks: int
    block_size: int
    layout: Literal["kv", "latent"] = "kv"
    #: The ``"latent"`` layout's pools ``[num_blocks, block_size, latent_dim]``, one per layer.
    latents: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> KVCache:
        """Allocate zeroed pools for every layer of ``config`` (the latent layout when it has ``mla``)."""
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(
                f"KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        if config.mla is not None:
            latent_shape = (num_blocks, block_size, config.mla.latent_dim)
            latents = [
                torch.zeros(latent_shape, device=device, dtype=dtype) for _ in range(config.num_layers)
            ]
            return cls(
                k=[], v=[], num_blocks=num_blocks, block_size=block_size, layout="latent", latents=latents
            )
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(config.num_layers)]
        return cls(k=k, v=v, num_blocks=num_blocks, block_size=block_size)

    @staticmethod
    def values_per_token(config: ModelConfig) -> int:
        """Values one token occupies across all layers: ``(kv_lora_rank + qk_rope_head_dim) * layers``
        for the latent layout, ``2 * num_kv_heads * head_dim * layers`` for K/V."""
        if config.mla is not None:
            return config.num_layers * config.mla.latent_dim
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers (to size the pool)."""
        elem = torch.empty((), dtype=dtype).element_size()
        return KVCache.values_per_token(config) * block_size * elem

    @property
    def num_slots(self) -> int:
        """Total token slots in the pool."""
        return self.num_blocks * self.block_size

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s K and V viewed as ``[num_slots, num_kv_heads, head_dim]`` (``"kv"`` layout)."""
        k, v = self.k[layer], self.v[layer]
        return k.view(-1, k.shape[2], k.shape[3]), v.view(-1, v.shape[2], v.shape[3])

    def latent(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s latent pool viewed as ``[num_slots, latent_dim]`` (``"latent"`` layout)."""
        pool = self.latents[layer]
        return pool.view(-1, pool.shape[-1])
