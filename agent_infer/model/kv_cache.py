"""The paged KV cache: per layer, pools of fixed-size blocks that the engine hands out.

Two layouts share the block addressing (a token's slot is ``block_id * block_size + offset``):
``"kv"`` holds K and V pools ``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer;
``"latent"`` (latent-attention models, :class:`~agent_infer.model.config.MLASpec`) holds one pool
``[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` per layer: each token's normalized kv
latent and its rotated shared RoPE key, from which the attention layer expands or absorbs K and V.
``"compressed"`` (DeepSeek V4, :class:`~agent_infer.model.config.DeepseekV4Spec`) holds per layer
a window pool ``[num_blocks, block_size, head_dim]`` (each token's rotated shared K=V entry) and, on
compressed layers, a state pool ``[num_blocks, ring, state]`` (compressor projections:
``2 * head_dim`` per token for heavily compressed attention, ``4 * (head_dim + index_head_dim)``
for compressed sparse attention, both series and the indexer's; a token at offset ``o`` of its
block sits at ``o % ring``, see :func:`state_ring`) plus an entry pool
``[num_blocks, block_size / s, entry]`` with ``s = min(rate, block_size)`` (``head_dim``, plus
``index_head_dim`` of indexer key on sparse layers). The entry of the window of tokens
``[w * rate, (w + 1) * rate)`` sits at the slot of its last token divided by ``s``: inside the block
that completes it, so a block's entries depend only on the tokens of its prefix chain and prefix
caching shares them with the block. Block sizes must divide or be divided by every rate.

A token's compressor state is read only until the windows that pool it are closed (its own, and on
sparse layers the next one), so a block keeps the states of its last ``ring`` tokens only: enough
for the open window, the window before it and a rolled-back draft of up to ``rollback`` tokens.
Where ``ring < block_size`` a position pool ``[num_blocks, ring]`` (int32) records which token each
ring slot holds, so a read of a state a deeper rollback overwrote raises instead of reading it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from agent_infer.errors import ConfigError
from agent_infer.model.config import DeepseekV4Spec, ModelConfig


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
    layout: Literal["kv", "latent", "compressed"] = "kv"
    #: The ``"latent"`` layout's pools ``[num_blocks, block_size, latent_dim]``, one per layer.
    latents: list[torch.Tensor] = field(default_factory=list)
    #: The ``"compressed"`` layout's pools per layer (module docstring); None where a layer has none.
    windows: list[torch.Tensor] = field(default_factory=list)
    states: list[torch.Tensor | None] = field(default_factory=list)
    entries: list[torch.Tensor | None] = field(default_factory=list)
    #: Per compressed layer, the position each state-ring slot holds (None where the ring is the block).
    state_positions: list[torch.Tensor | None] = field(default_factory=list)
    #: The deepest draft rollback the state rings are sized for.
    rollback: int = 0

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        rollback: int | None = None,
    ) -> KVCache:
        """Allocate zeroed pools for every layer of ``config`` (the latent layout when it has ``mla``;
        the compressed one, with state rings sized for ``rollback`` draft tokens, default
        :data:`MAX_ROLLBACK`, when it has ``deepseek_v4``)."""
        if num_blocks < 1 or block_size < 1:
            raise ConfigError(
                f"KV cache needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        if config.deepseek_v4 is not None:
            return cls._allocate_compressed(
                config, config.deepseek_v4, num_blocks, block_size, device, dtype,
                MAX_ROLLBACK if rollback is None else rollback,
            )  # fmt: skip
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

    @classmethod
    def _allocate_compressed(
        cls,
        config: ModelConfig,
        spec: DeepseekV4Spec,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        rollback: int,
    ) -> KVCache:
        check_compressed_block_size(spec, block_size)
        windows: list[torch.Tensor] = []
        states: list[torch.Tensor | None] = []
        entries: list[torch.Tensor | None] = []
        positions: list[torch.Tensor | None] = []
        for layer in range(config.num_layers):
            window, state, entry = compressed_widths(config, spec, layer)
            windows.append(torch.zeros(num_blocks, block_size, window, device=device, dtype=dtype))
            stride = spec.entry_stride(layer, block_size)
            if not stride:
                states.append(None)
                entries.append(None)
                positions.append(None)
                continue
            ring = state_ring(spec, layer, block_size, rollback)
            states.append(torch.zeros(num_blocks, ring, state, device=device, dtype=dtype))
            positions.append(
                torch.full((num_blocks, ring), -1, device=device, dtype=torch.int32)
                if ring < block_size
                else None
            )
            entries.append(torch.zeros(num_blocks, block_size // stride, entry, device=device, dtype=dtype))
        return cls(
            k=[],
            v=[],
            num_blocks=num_blocks,
            block_size=block_size,
            layout="compressed",
            windows=windows,
            states=states,
            entries=entries,
            state_positions=positions,
            rollback=rollback,
        )

    @staticmethod
    def values_per_token(config: ModelConfig) -> int:
        """Values one token occupies across all layers: ``(kv_lora_rank + qk_rope_head_dim) * layers``
        for the latent layout, ``2 * num_kv_heads * head_dim * layers`` for K/V (the compressed
        layout depends on the block size: :meth:`bytes_per_block`)."""
        if config.deepseek_v4 is not None:
            raise ConfigError("the compressed layout's size depends on the block size; use bytes_per_block")
        if config.mla is not None:
            return config.num_layers * config.mla.latent_dim
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim

    @staticmethod
    def bytes_per_block(
        config: ModelConfig, block_size: int, dtype: torch.dtype, rollback: int | None = None
    ) -> int:
        """Bytes one block takes across all layers (to size the pool; ``rollback`` as for
        :meth:`allocate`)."""
        elem = torch.empty((), dtype=dtype).element_size()
        spec = config.deepseek_v4
        if spec is not None:
            check_compressed_block_size(spec, block_size)
            values = position_bytes = 0
            for layer in range(config.num_layers):
                window, state, entry = compressed_widths(config, spec, layer)
                stride = spec.entry_stride(layer, block_size)
                values += window * block_size
                if stride:
                    ring = state_ring(spec, layer, block_size, MAX_ROLLBACK if rollback is None else rollback)
                    values += state * ring + entry * (block_size // stride)
                    position_bytes += 4 * ring if ring < block_size else 0
            return values * elem + position_bytes
        return KVCache.values_per_token(config) * block_size * elem

    @staticmethod
    def bytes_per_token(
        config: ModelConfig, block_size: int, dtype: torch.dtype, rollback: int | None = None
    ) -> float:
        """Bytes per token of a pool of ``block_size``-token blocks (a fraction where compressed
        entries are shared by several tokens or states kept for part of a block)."""
        return KVCache.bytes_per_block(config, block_size, dtype, rollback) / block_size

    def block_pools(self) -> list[torch.Tensor]:
        """Every pool whose leading dimension is the block, in a fixed order (K, V, latents, then the
        compressed layout's windows, states, entries and state positions).

        Whatever moves a block's contents (the host KV tier, the prefill/decode transfer) copies
        row ``block_id`` of each of these, so a layout's extra pools travel with its blocks.
        """
        optional = [*self.states, *self.entries, *self.state_positions]
        return [*self.k, *self.v, *self.latents, *self.windows, *(p for p in optional if p is not None)]

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

    def window(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s window pool as ``[num_slots, head_dim]`` (``"compressed"`` layout)."""
        pool = self.windows[layer]
        return pool.view(-1, pool.shape[-1])

    def compressor(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``layer``'s state pool ``[num_slots, state]`` and entry pool ``[num_entry_slots, entry]``
        (``"compressed"`` layout), or None for a sliding-window-only layer."""
        state, entry = self.states[layer], self.entries[layer]
        if state is None or entry is None:
            return None
        return state.view(-1, state.shape[-1]), entry.view(-1, entry.shape[-1])

    def state_ring(self, layer: int) -> tuple[int, torch.Tensor | None]:
        """Layer ``layer``'s state-ring length and its flat position pool (None where the ring is
        the whole block) (``"compressed"`` layout, compressed layers)."""
        state, positions = self.states[layer], self.state_positions[layer]
        assert state is not None
        return int(state.shape[1]), None if positions is None else positions.view(-1)


#: The deepest draft (tokens fed in one step, then rejected) the compressed layout's state rings
#: are sized for by default: the engine's largest ``speculative_tokens``.
MAX_ROLLBACK = 32


def state_ring(spec: DeepseekV4Spec, layer: int, block_size: int, rollback: int) -> int:
    """Compressor-state slots a block of compressed ``layer`` keeps.

    After a step, the next one reads the states of the still open window (at most ``rate - 1``
    tokens) and, on sparse layers, of the window before it (``rate`` more); a rejected draft of up
    to ``rollback`` tokens may have written past them. A block's last ``ring`` tokens cover this
    when ``ring >= (2 if sparse else 1) * rate - 1 + rollback``; never more than the block."""
    rate = spec.compress_rates[layer]
    return min(block_size, (2 if spec.sparse[layer] else 1) * rate - 1 + rollback)


def compressed_widths(config: ModelConfig, spec: DeepseekV4Spec, layer: int) -> tuple[int, int, int]:
    """Values per token of ``layer``'s window and state pools and per entry of its entry pool
    (state and entry are 0 on sliding-window-only layers)."""
    d, di = config.head_dim, spec.index_head_dim
    if not spec.compress_rates[layer]:
        return d, 0, 0
    if spec.sparse[layer]:
        return d, 4 * (d + di), d + di
    return d, 2 * d, d


def check_compressed_block_size(spec: DeepseekV4Spec, block_size: int) -> None:
    """Raise :class:`ConfigError` unless ``block_size`` divides, or is divided by, every compression rate."""
    for layer, rate in enumerate(spec.compress_rates):
        if rate and block_size % rate and rate % block_size:
            raise ConfigError(
                f"block_size={block_size} does not align with layer {layer}'s compression rate {rate}: "
                "one must divide the other"
            )
