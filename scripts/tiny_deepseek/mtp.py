"""One multi-token-prediction (MTP) module, as the DeepSeek-V3 report describes it (section 2.2).

Depth 1: at position ``i`` the module combines the main model's hidden state ``h_i`` with the
embedding of the next token ``t_{i+1}``,

    h'_i = M [RMSNorm(Emb(t_{i+1})) ; RMSNorm(h_i)]        (``eh_proj``; ``enorm``, ``hnorm``)
    h_i^1 = Block(h'_1..i)                                 (a decoder layer, causal over positions)
    P_{i+2} = softmax(Head(RMSNorm(h_i^1)))                (``shared_head.norm``, the shared head)

and is trained on token ``t_{i+2}`` with weight ``lambda`` (0.3, the report's value for most of
training). The embedding and the output head are the main model's. The concatenation puts the
embedding half first, as DeepSeek's released ``eh_proj`` weights (and vLLM / SGLang reading them)
do; ``h_i`` is the main model's final-normed hidden state, what those engines hand the module.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: The MTP loss weight lambda of the DeepSeek-V3 report.
MTP_LOSS_WEIGHT = 0.3


class RMSNorm(nn.Module):
    """RMSNorm with DeepSeek's float32 statistics."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalized ``x`` scaled by the weight."""
        var = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype)


class MTPModule(nn.Module):
    """The depth-1 MTP module over a decoder ``block`` of the main model's architecture."""

    def __init__(
        self, hidden: int, eps: float, block: nn.Module, streams: int = 1, collapse: nn.Module | None = None
    ) -> None:
        """``streams`` > 1 (V4's hyper-connections): the block takes ``[B, T, streams, hidden]``, the
        projection is copied to every stream (as V4 does with the embeddings) and ``collapse`` (V4's
        hyper-connection head, saved as ``hc_head.*``) folds the block's streams back into one."""
        super().__init__()
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = block
        self.streams = streams
        self.hc_head = collapse
        self.head_norm = RMSNorm(hidden, eps)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor, **block_kwargs: Any) -> torch.Tensor:
        """Normed states ``[B, T, hidden]`` for the head: ``hidden`` is the main model's at positions
        ``0..T-1``, ``next_embeds`` the embeddings of tokens ``1..T``; ``block_kwargs`` go to the block."""
        return self.head_norm(self.trunk(hidden, next_embeds, **block_kwargs))

    def trunk(self, hidden: torch.Tensor, next_embeds: torch.Tensor, **block_kwargs: Any) -> torch.Tensor:
        """The module's output before the head's norm (``h^k`` of the report: what a next module
        takes as its ``hidden``)."""
        x = self.eh_proj(torch.cat((self.enorm(next_embeds), self.hnorm(hidden)), dim=-1))
        if self.streams > 1:
            x = x.unsqueeze(2).expand(-1, -1, self.streams, -1).contiguous()
        out = self.block(x, **block_kwargs)
        if isinstance(out, tuple):
            out = out[0]
        if self.hc_head is not None:
            out = self.hc_head(out)
        return out

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The module's own tensors by DeepSeek's names under ``model.layers.{N}.`` (the block's are
        named by the caller, like a main decoder layer's; the head is the shared one)."""
        out = {
            "enorm.weight": self.enorm.weight.detach(),
            "hnorm.weight": self.hnorm.weight.detach(),
            "eh_proj.weight": self.eh_proj.weight.detach(),
            "shared_head.norm.weight": self.head_norm.weight.detach(),
        }
        if self.hc_head is not None:
            out.update({"hc_head." + k: v.detach() for k, v in self.hc_head.state_dict().items()})
        return out
