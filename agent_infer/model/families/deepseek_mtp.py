"""DeepSeek V3's multi-token-prediction (MTP / NextN) modules: the draft heads a checkpoint carries.

Module ``i`` lives under ``model.layers.{num_hidden_layers + i}.`` in DeepSeek's released
checkpoints. From the hidden state ``h`` of position ``p`` (the main model's, or the previous
module step's) and the token ``t`` at position ``p + 1`` it predicts the token at ``p + 2``::

    x  = eh_proj([enorm(embed(t)) ; hnorm(h)])       # 2*hidden -> hidden
    h' = Block(x)                                      # one decoder block: MLA + MLP/MoE, own cache
    logits = shared_head.head(shared_head.norm(h'))

The concatenation puts the normed embedding first and the normed hidden state second: that is the
order the released ``eh_proj`` weights are trained for, as DeepSeek's inference integration in vLLM
(``deepseek_mtp.py``) and SGLang (``deepseek_nextn.py``) apply it (the V3 report's equation writes
the two halves the other way round). As there, the main model's hidden state is its final-norm
output, a chained step feeds ``h'`` (before ``shared_head.norm``), and the block's attention is an
MLA layer with its own latent cache, addressed by the same slots as the main model's.

``embed_tokens`` and ``shared_head.head`` are optional per module: DeepSeek stores copies of the
main model's; a checkpoint without them uses the main model's embedding and head.

The engine drives a checkpoint's modules through an :class:`MTPStack` (this family's
:class:`DeepseekMTPStack`, V4's in ``deepseek_v4_mtp.py``): one pass of module ``depth`` over rows
described by :class:`MTPRows`, each sequence's context given by its slots in the module's own cache
pool, so committed positions (the paged slots) and chained draft positions (scratch slots) are
addressed alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from agent_infer.errors import EngineError
from agent_infer.model.config import ModelConfig
from agent_infer.model.families.base import Targets
from agent_infer.model.layers.attention import AttentionPlan, _sdpa_plan
from agent_infer.model.layers.kernels import Kernels
from agent_infer.model.layers.linear import Linear, WeightPart
from agent_infer.model.layers.norm import RMSNorm
from agent_infer.model.layers.rotary import RotaryEmbedding, Rotation


class MTPBlock(Protocol):
    """The decoder block an MTP module wraps (the family's own block type)."""

    def forward(
        self, x: torch.Tensor, rotation: Rotation, cache: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor: ...

    def load_targets(self) -> Targets: ...


#: Tensor names (after the module's prefix) a checkpoint may omit; the main model's stand in.
OPTIONAL_SUFFIXES = ("embed_tokens.weight", "shared_head.head.weight")


class MTPLayer(nn.Module):
    """One MTP module (HF names under ``model.layers.{num_layers + depth}.``)."""

    def __init__(
        self,
        config: ModelConfig,
        depth: int,
        block: MTPBlock,
        kernels: Kernels,
        device: torch.device | None,
        dtype: torch.dtype,
    ) -> None:
        """``block`` is the family's decoder block built for index ``num_layers + depth``."""
        super().__init__()
        c = config
        self.prefix = p = f"model.layers.{c.num_layers + depth}."
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.eh_proj: Linear = kernels.linears.linear(
            [WeightPart(p + "eh_proj.weight", c.hidden_size)], 2 * c.hidden_size
        )
        self.block = block
        self.head_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.shape = (c.vocab_size, c.hidden_size)
        self._device, self._dtype = device, dtype
        #: The module's own embedding and head, when the checkpoint stores them (see the module docstring).
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
        rotation: Rotation,
        cache: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        """``h'`` ``[rows, hidden]`` for hidden states ``hidden`` and next tokens ``token_ids`` (one
        per row), writing the block's latent entries into ``cache`` at ``plan``'s slots."""
        embed = self.embed if self.embed is not None else main_embed
        e = self.enorm.forward(F.embedding(token_ids, embed))
        x = self.eh_proj.project(torch.cat((e, self.hnorm.forward(hidden.to(e.dtype))), dim=-1))
        return self.block.forward(x, rotation, cache, plan)

    def logits(self, h: torch.Tensor, main_head: Linear) -> torch.Tensor:
        """Float32 logits ``[rows, vocab]`` of ``h'`` (through ``main_head`` when the module has no
        head of its own)."""
        normed = self.head_norm.forward(h)
        if self.head is None:
            return main_head.logits(normed, None)
        return F.linear(normed, self.head).float()


def split_mtp_name(name: str, layers: list[MTPLayer]) -> tuple[MTPLayer, str] | None:
    """The MTP layer a checkpoint tensor belongs to and its name after the layer's prefix, or None."""
    for layer in layers:
        if name.startswith(layer.prefix):
            return layer, name[len(layer.prefix) :]
    return None


@dataclass
class MTPRows:
    """The rows of one MTP pass: per sequence, the cache slots of its whole context in position order
    (its ``counts[i]`` new rows' slots last); the new rows' positions and slots, concatenated."""

    gathers: list[torch.Tensor]
    counts: list[int]
    positions: torch.Tensor
    slot_mapping: torch.Tensor

    @property
    def num_rows(self) -> int:
        """New rows in the pass."""
        return int(self.positions.numel())


class MTPStack(Protocol):
    """A checkpoint's MTP modules as the engine's drafter runs them."""

    #: How many modules the checkpoint has (module ``i`` predicts ``i + 2`` tokens ahead).
    depth: int
    #: Values one token takes in one module's cache pool.
    cache_width: int

    def forward(
        self, depth: int, hidden: torch.Tensor, token_ids: torch.Tensor, rows: MTPRows, pool: torch.Tensor
    ) -> torch.Tensor:
        """Module ``depth``'s ``h'`` for input states ``hidden`` ``[rows, hidden]`` and the tokens fed
        with them, writing the rows' entries into ``pool`` ``[slots, cache_width]``."""
        ...

    def head(self, depth: int) -> tuple[RMSNorm, torch.Tensor]:
        """Module ``depth``'s norm before its output head, and the head's full weight ``[vocab, hidden]``."""
        ...


def head_weight(layer_head: torch.Tensor | None, main_head: Linear) -> torch.Tensor:
    """A module's head weight: its own, else the main model's (which must be a torch weight)."""
    if layer_head is not None:
        return layer_head
    weight = getattr(main_head, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise EngineError("MTP drafts need the main model's output head as a torch weight")
    return weight


def attention_plan(rows: MTPRows, device: torch.device) -> AttentionPlan:
    """The SDPA plan of ``rows``: each sequence's new rows attend causally to its context."""
    seqs = []
    start = 0
    for gather, count in zip(rows.gathers, rows.counts):
        seqs.append(_sdpa_plan(start, start + count, int(gather.numel()), gather, None, device))
        start += count
    return AttentionPlan(seqs=seqs, slot_mapping=rows.slot_mapping, num_tokens=start)


class DeepseekMTPStack:
    """The :class:`MTPStack` of a DeepSeek V3 model's :class:`MTPLayer` modules (latent caches)."""

    def __init__(
        self,
        layers: list[MTPLayer],
        embed: torch.Tensor,
        main_head: Linear,
        rotary: RotaryEmbedding,
        latent_dim: int,
    ) -> None:
        self.layers = layers
        self.embed = embed
        self.main_head = main_head
        self.rotary = rotary
        self.depth = len(layers)
        self.cache_width = latent_dim

    def forward(
        self, depth: int, hidden: torch.Tensor, token_ids: torch.Tensor, rows: MTPRows, pool: torch.Tensor
    ) -> torch.Tensor:
        """See :meth:`MTPStack.forward`."""
        plan = attention_plan(rows, pool.device)
        rotation = self.rotary.at(rows.positions)
        return self.layers[depth].forward(hidden, token_ids, self.embed, rotation, pool, plan)

    def head(self, depth: int) -> tuple[RMSNorm, torch.Tensor]:
        """See :meth:`MTPStack.head`."""
        layer = self.layers[depth]
        return layer.head_norm, head_weight(layer.head, self.main_head)
