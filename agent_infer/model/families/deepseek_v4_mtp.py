"""DeepSeek V4's multi-token-prediction (MTP) modules, as the engine's draft source.

Module ``i`` lives under ``model.layers.{num_hidden_layers + i}.``: DeepSeek V3's module
(:mod:`.deepseek_mtp`) around a V4 decoder block, whose residual is ``hc_mult`` streams::

    x  = eh_proj([enorm(embed(t)) ; hnorm(h)])          # 2*hidden -> hidden
    s  = Block([x] * hc_mult)                             # a V4 block: hyper-connected attention + MoE
    h' = hc_head(s)                                       # the module's own stream collapse (hc_head.hc_*)
    logits = shared_head.head(shared_head.norm(h'))

``h`` is the main model's final-norm hidden state (or, chained, the previous module step's ``h'``).
The block is a sliding-window layer (the model's ``sliding_window``, no compressor) with top-k
routed experts: the layout ``scripts/train_tiny_deepseek.py`` trains and saves. Its window cache is
one more pool, addressed by the main cache's slots. ``embed_tokens`` and ``shared_head.head`` are
optional, as for V3.

A checkpoint whose MTP tensors are not exactly such modules (another layout, a partial set) loads
without its MTP modules; ``DeepseekV4ForCausalLM.mtp_skipped`` says why, and asking for MTP drafts
names it. :func:`split_mtp_tensors` and :func:`load_mtp` do the sorting and the checking.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from agent_infer.model.config import ModelConfig
from agent_infer.model.families.base import Targets
from agent_infer.model.families.deepseek_mtp import MTPRows, head_weight
from agent_infer.model.kv_cache import KVCache
from agent_infer.model.layers.compressed_plan import CompressedPlan, SeqView
from agent_infer.model.layers.hyper_connections import HyperHead
from agent_infer.model.layers.interleaved_rotary import InterleavedRotary
from agent_infer.model.layers.kernels import Kernels
from agent_infer.model.layers.linear import Linear, WeightPart
from agent_infer.model.layers.norm import RMSNorm

#: Tensor names (after the module's prefix) a checkpoint may omit; the main model's stand in.
OPTIONAL_SUFFIXES = ("embed_tokens.weight", "shared_head.head.weight")


def mtp_config(config: ModelConfig) -> ModelConfig:
    """``config`` with the MTP blocks' layer types appended (sliding-window, top-k routed), so a V4
    block can be built at index ``num_layers + i``."""
    spec = config.deepseek_v4
    assert spec is not None
    extra = config.num_nextn_layers
    wide = dataclasses.replace(
        spec,
        compress_rates=(*spec.compress_rates, *(0,) * extra),
        sparse=(*spec.sparse, *(False,) * extra),
        hash_layers=(*spec.hash_layers, *(False,) * extra),
    )
    return dataclasses.replace(config, deepseek_v4=wide)


class V4MTPBlock(Protocol):
    """The V4 decoder block an MTP module wraps (the family's own block type)."""

    def forward(
        self,
        streams: torch.Tensor,
        ids: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        plan: CompressedPlan,
    ) -> torch.Tensor: ...

    def load_targets(self) -> Targets: ...


class V4MTPLayer(nn.Module):
    """One V4 MTP module (HF names under ``model.layers.{num_layers + depth}.``)."""

    def __init__(
        self,
        config: ModelConfig,
        depth: int,
        block: V4MTPBlock,
        kernels: Kernels,
        device: torch.device | None,
        dtype: torch.dtype,
    ) -> None:
        """``block`` is the family's decoder block built at index ``num_layers + depth`` of
        :func:`mtp_config`."""
        super().__init__()
        c, spec = config, config.deepseek_v4
        assert spec is not None
        self.index = c.num_layers + depth
        self.prefix = p = f"model.layers.{self.index}."
        self.streams = spec.hc_mult
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.eh_proj: Linear = kernels.linears.linear(
            [WeightPart(p + "eh_proj.weight", c.hidden_size)], 2 * c.hidden_size
        )
        self.block = block
        self.hc_head = HyperHead(c.hidden_size, spec.hc_mult, spec.hc_eps, c.rms_norm_eps, device)
        self.head_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.shape = (c.vocab_size, c.hidden_size)
        self._device, self._dtype = device, dtype
        self.embed: nn.Parameter | None = None
        self.head: nn.Parameter | None = None

    def load_targets(self) -> Targets:
        """HF names of the module's required tensors (the optional ones are taken by :meth:`own`)."""
        p = self.prefix
        t: Targets = {}
        for name, norm in (
            ("enorm", self.enorm),
            ("hnorm", self.hnorm),
            ("shared_head.norm", self.head_norm),
        ):
            t[p + name + ".weight"] = (norm.weight, 0, tuple(norm.weight.shape))
        h = self.hc_head
        for name, tensor in (("hc_fn", h.fn), ("hc_base", h.base), ("hc_scale", h.scale)):
            t[p + "hc_head." + name] = (tensor, 0, tuple(tensor.shape))
        t.update(self.eh_proj.load_targets())
        t.update(self.block.load_targets())
        return t

    def own(self, suffix: str) -> torch.Tensor:
        """Allocate the module's own ``embed_tokens`` or ``shared_head.head`` (``suffix``) and return it."""
        param = nn.Parameter(
            torch.empty(self.shape, device=self._device, dtype=self._dtype), requires_grad=False
        )
        if suffix == "embed_tokens.weight":
            self.embed = param
        else:
            self.head = param
        return param

    def forward(
        self,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        main_embed: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        plan: CompressedPlan,
    ) -> torch.Tensor:
        """``h'`` ``[rows, hidden]`` for states ``hidden`` and the tokens fed with them, writing the
        block's window entries into ``cache`` (layer ``index``) at ``plan``'s slots."""
        embed = self.embed if self.embed is not None else main_embed
        e = self.enorm.forward(F.embedding(token_ids, embed))
        x = self.eh_proj.project(torch.cat((e, self.hnorm.forward(hidden.to(e.dtype))), dim=-1))
        streams = x[:, None, :].expand(int(x.shape[0]), self.streams, int(x.shape[1])).contiguous()
        streams = self.block.forward(streams, token_ids, tables, cache, plan)
        return self.hc_head.forward(streams)


def window_plan(rows: MTPRows, window: int, block_size: int) -> CompressedPlan:
    """The sliding-window plan of ``rows``: each sequence's new rows attend to the keys of their
    window among its context slots."""
    seqs = []
    start = 0
    device = rows.positions.device
    for gather, count in zip(rows.gathers, rows.counts):
        ctx = int(gather.numel())
        first = ctx - count
        qpos = torch.arange(first, ctx, device=device)
        lo = max(0, first - window + 1)
        kpos = torch.arange(lo, ctx, device=device)
        allowed = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - window)
        seqs.append(SeqView(start, start + count, gather, qpos, gather[lo:ctx], allowed, {}))
        start += count
    ends = torch.tensor([int(g.numel()) for g in rows.gathers], dtype=torch.int64, device=device)
    counts = torch.tensor(rows.counts, dtype=torch.int64, device=device)
    return CompressedPlan(
        seqs, rows.slot_mapping, start, block_size, {}, rows.positions, ends.repeat_interleave(counts)
    )


class DeepseekV4MTPStack:
    """The :class:`~.deepseek_mtp.MTPStack` of a V4 model's :class:`V4MTPLayer` modules (window caches)."""

    def __init__(
        self,
        layers: list[V4MTPLayer],
        embed: torch.Tensor,
        main_head: Linear,
        rotary: InterleavedRotary,
        config: ModelConfig,
    ) -> None:
        spec = config.deepseek_v4
        assert spec is not None
        self.layers = layers
        self.embed = embed
        self.main_head = main_head
        self.rotary = rotary
        self.window = spec.sliding_window
        self.depth = len(layers)
        self.cache_width = config.head_dim

    def forward(
        self, depth: int, hidden: torch.Tensor, token_ids: torch.Tensor, rows: MTPRows, pool: torch.Tensor
    ) -> torch.Tensor:
        """See :meth:`~.deepseek_mtp.MTPStack.forward`."""
        layer = self.layers[depth]
        plan = window_plan(rows, self.window, 1)
        # The block reads its window pool as layer ``index`` of a compressed-layout cache.
        slots = int(pool.shape[0])
        empty = pool.new_zeros(0, 1)
        cache = KVCache(
            k=[], v=[], num_blocks=slots, block_size=1, layout="compressed",
            windows=[*([empty] * layer.index), pool.view(slots, 1, -1)],
            states=[None] * (layer.index + 1), entries=[None] * (layer.index + 1),
            state_positions=[None] * (layer.index + 1),
        )  # fmt: skip
        tables = self.rotary.tables(rows.positions)
        return layer.forward(hidden, token_ids, self.embed, tables, cache, plan)

    def head(self, depth: int) -> tuple[RMSNorm, torch.Tensor]:
        """See :meth:`~.deepseek_mtp.MTPStack.head`."""
        layer = self.layers[depth]
        return layer.head_norm, head_weight(layer.head, self.main_head)


def split_mtp_tensors(
    named: Iterable[tuple[str, torch.Tensor]], prefixes: tuple[str, ...], found: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the tensors of ``named`` outside the MTP ``prefixes``; keep the others in ``found``."""
    for name, tensor in named:
        if name.startswith(prefixes):
            found[name] = tensor
        else:
            yield name, tensor


@torch.no_grad()
def load_mtp(layers: list[V4MTPLayer], tensors: dict[str, torch.Tensor]) -> str | None:
    """Copy ``tensors`` into ``layers``; None when they were exactly the modules' tensors, else why
    not (nothing is kept then, and the caller drops the modules)."""
    if not tensors:
        return "the checkpoint stores no MTP tensors"
    targets: Targets = {}
    optional: dict[str, tuple[V4MTPLayer, str]] = {}
    for layer in layers:
        targets.update(layer.load_targets())
        for suffix in OPTIONAL_SUFFIXES:
            optional[layer.prefix + suffix] = (layer, suffix)
    unknown = sorted(set(tensors) - set(targets) - set(optional))
    missing = sorted(set(targets) - set(tensors))
    if unknown or missing:
        names = unknown or missing
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        what = "unexpected" if unknown else "missing"
        return f"its MTP tensors are not the modules this engine runs ({what}: {', '.join(names[:3])}{more})"
    for name, tensor in tensors.items():
        if name in optional:
            layer, suffix = optional[name]
            if tuple(tensor.shape) != layer.shape:
                return f"MTP tensor {name!r} has shape {tuple(tensor.shape)}, expected {layer.shape}"
            layer.own(suffix).copy_(tensor)
            continue
        dest, off, shape = targets[name]
        if tuple(tensor.shape) != shape:
            return f"MTP tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}"
        dest[off : off + shape[0]].copy_(tensor)
    return None
