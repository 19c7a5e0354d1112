"""What every architecture family provides: the causal-LM contract with the engine and loading by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import ClassVar, Generic, Literal, TypeVar, cast

import torch
from torch import nn

from agent_infer.errors import EngineError, ModelLoadError
from agent_infer.model.config import ModelConfig
from agent_infer.model.kv_cache import KVCache
from agent_infer.model.layers.attention import AttentionMetadata
from agent_infer.model.layers.kernels import Kernels, torch_kernels
from agent_infer.model.layers.linear import Linear, pad_rows

#: HF name -> (destination tensor, first row inside it, expected shape of the checkpoint tensor).
Targets = dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]

# HF buffers that some checkpoints carry but which the families recompute.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def model_kernels(kernels: Kernels | None, device: torch.device | None, dtype: torch.dtype) -> Kernels:
    """The kernels a family builds its layers with: the torch path on ``device``/``dtype`` unless the
    loader chose others; the packed native path needs a float32 model on the CPU."""
    if kernels is None:
        return torch_kernels(device, dtype)
    if kernels.name == "native" and (
        dtype != torch.float32 or (device is not None and torch.device(device).type != "cpu")
    ):
        raise EngineError("the native kernels need a float32 model on the CPU")
    return kernels


#: A family's decoder block type.
BlockT = TypeVar("BlockT", bound=nn.Module)
#: The :class:`KVCache` layouts (``KVCache.layout``).
KVLayout = Literal["kv", "latent", "compressed"]


class CausalLM(nn.Module, ABC, Generic[BlockT]):
    """A decoder over a paged :class:`KVCache`, built from the :class:`Kernels` the loader chose.

    Subclasses build their layers in ``__init__`` (``embed``, ``layers`` of ``BlockT``, ``lm_head``) and
    implement :meth:`decoder_forward` and :meth:`weight_targets`; the checks of :meth:`forward`, the
    head and loading by name are shared.
    """

    config: ModelConfig
    dtype: torch.dtype
    kernels: Kernels
    embed: nn.Parameter
    layers: nn.ModuleList
    lm_head: Linear
    #: The cache layout the decoder reads and writes (the one ``KVCache.allocate`` gives its config).
    kv_layout: ClassVar[KVLayout] = "kv"

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.embed.device

    @property
    def native(self) -> bool:
        """Whether the model runs the packed native kernels."""
        return self.kernels.name == "native"

    @property
    def masked_head(self) -> bool:
        """Whether :meth:`compute_logits` skips the head weights of tokens no row of ``allowed`` takes
        (the packed head can; the torch head computes every column)."""
        return self.lm_head.takes_token_mask

    def blocks(self) -> list[BlockT]:
        """The decoder layers, typed."""
        return cast(list[BlockT], list(self.layers))

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        keep_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Run the new tokens of a batch through the decoder, caching what its layout keeps; the
        final-norm hidden states ``[N, hidden]`` of every row, or of ``keep_rows`` (in that order).

        A cache of another layout than :attr:`kv_layout`, or a position past the model's context,
        raises :class:`EngineError`.
        """
        if kv_cache.layout != self.kv_layout:
            raise EngineError(
                f"a {self.config.architecture} model needs a KV cache in the {self.kv_layout} layout "
                f"(KVCache.allocate of its config), got the {kv_cache.layout} layout"
            )
        limit = self.config.max_position_embeddings
        if int(input_ids.shape[0]) and int(positions.max()) >= limit:
            raise EngineError(f"position {int(positions.max())} is beyond the model's {limit}-token context")
        with self.kernels.threads():
            return self.decoder_forward(input_ids, positions, meta, kv_cache, keep_rows)

    @abstractmethod
    def decoder_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        keep_rows: Sequence[int] | None,
    ) -> torch.Tensor:
        """:meth:`forward` past its checks, inside the kernels' thread budget."""

    def padded_inputs(
        self, input_ids: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and positions on the model's device, zero-padded to the kernels' row multiple."""
        n = int(input_ids.shape[0])
        rows = pad_rows(n, self.kernels.row_multiple)
        ids = input_ids.to(self.device)
        pos = positions.to(self.device)
        if rows > n:
            ids = torch.cat((ids, ids.new_zeros(rows - n)))
            pos = torch.cat((pos, pos.new_zeros(rows - n)))
        return ids, pos

    @staticmethod
    def select_rows(hidden: torch.Tensor, n: int, keep_rows: Sequence[int] | None) -> torch.Tensor:
        """The first ``n`` rows of ``hidden`` (the unpadded ones), or the ``keep_rows`` in that order."""
        if keep_rows is not None:
            return hidden.index_select(
                0, torch.tensor(list(keep_rows), dtype=torch.int64, device=hidden.device)
            )
        return hidden[:n]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Project hidden states ``[M, hidden]`` to float32 logits ``[M, vocab]`` (batch invariant).

        ``allowed`` (int32 token bitmask ``[M, words]``, e.g. a grammar's) lets a :attr:`masked_head`
        skip the weights of tokens no row can take: those logits come back ``-inf`` and every other
        one is bit-identical. Other heads ignore it (the caller masks anyway).
        """
        with self.kernels.threads():
            return self.lm_head.logits(hidden, allowed)

    @abstractmethod
    def weight_targets(self) -> Targets:
        """Every tensor still to be loaded by name (the packed ones are not)."""

    @staticmethod
    def hf_tensor(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """A Hugging Face checkpoint tensor as ``(name, tensor)`` in the form this family holds it
        (as stored by default), or None for a tensor the family does not use."""
        return name, tensor

    def ignored_weight_names(self) -> frozenset[str]:
        """Checkpoint tensors that may appear and are dropped (a tied head stored anyway)."""
        return frozenset()

    def packed_weight_names(self) -> frozenset[str]:
        """HF names of the tensors the model already holds packed (the loader need not read them)."""
        names: set[str] = set()
        for module in self.modules():
            packed = getattr(module, "packed_names", None)
            if packed is not None:
                names.update(packed())
        return frozenset(names)

    def accept_missing(self, missing: list[str]) -> list[str]:
        """The targets a checkpoint left out that are still an error (a family may drop optional
        modules whose tensors are absent); all of them by default."""
        return missing

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model (dtype converted); every target must appear exactly once.

        Raises :class:`ModelLoadError` naming any missing, unexpected, duplicated or mis-shaped tensor.
        """
        targets = self.weight_targets()
        ignored = self.ignored_weight_names()
        seen: set[str] = set()
        for name, tensor in named_tensors:
            if name.endswith(_IGNORED_SUFFIXES) or name in ignored:
                continue
            if name not in targets:
                raise ModelLoadError(f"unexpected tensor {name!r} for a {self.config.architecture} model")
            if name in seen:
                raise ModelLoadError(f"tensor {name!r} appears twice")
            dest, off, shape = targets[name]
            if tuple(tensor.shape) != shape:
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
            dest[off : off + shape[0]].copy_(tensor)
            seen.add(name)
        missing = self.accept_missing(sorted(set(targets) - seen))
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ModelLoadError(f"missing tensors: {', '.join(missing[:5])}{more}")
