"""DeepSeek V4's lightning indexer: which compressed entries each query of a sparse layer attends to.

The indexer keeps its own compressed keys (a :class:`WindowCompressor` at ``index_head_dim``, over
the same windows as the layer's) and scores entry ``s`` for the query at position ``t`` as
``sum_h w_{t,h} * relu(q_{t,h} . k_s) / sqrt(index_head_dim)``, with ``q`` projected from the
layer's query latent and ``w`` from its input. Only entries whose window is complete by ``t``
(``s < (t + 1) // rate``) compete, and each query keeps its ``index_topk`` best of them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agent_infer.model.layers.compressor import WindowCompressor
from agent_infer.model.layers.linear import Linear, LinearBuilder, WeightPart


class LightningIndexer(nn.Module):
    """The indexer of one sparse layer (HF names under ``...attn.indexer.``)."""

    def __init__(
        self,
        prefix: str,
        linears: LinearBuilder,
        rate: int,
        heads: int,
        dim: int,
        topk: int,
        q_lora_rank: int,
        eps: float,
        device: torch.device | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.heads = heads
        self.dim = dim
        self.topk = topk
        self.rate = rate
        self.q_up: Linear = linears.linear([WeightPart(prefix + "wq_b.weight", heads * dim)], q_lora_rank)
        self.compressor = WindowCompressor(rate, dim, True, eps, device, dtype)
        self.score_scale = dim**-0.5
        self.weight_scale = heads**-0.5

    def select(
        self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, ready: torch.Tensor
    ) -> torch.Tensor:
        """Bool ``[L, E]``: the entries each query keeps. ``q`` ``[L, heads, dim]`` (rotated),
        ``weights`` ``[L, heads]`` (unscaled projection), ``keys`` ``[E, dim]`` shared by the
        queries or ``[L, E, dim]`` one set per query, ``ready`` ``[L, E]`` the entries complete by
        each query."""
        entries = int(keys.shape[-2])
        scores = torch.matmul(q.float(), keys.float().transpose(-1, -2))  # [L, heads, E]
        scores = F.relu(scores) * self.score_scale
        total = (scores * (weights.float() * self.weight_scale).unsqueeze(-1)).sum(dim=1)
        total = total.masked_fill(~ready, float("-inf"))
        chosen = total.topk(min(self.topk, entries), dim=-1).indices
        keep = torch.zeros_like(ready).scatter_(1, chosen, True)
        return keep & ready
