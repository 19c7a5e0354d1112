"""Mixture of experts: top-k routed SwiGLU experts plus optional always-on shared experts.

The layout DeepSeekMoE and Qwen-MoE checkpoints share: a router ``[E, H]`` scores every expert
per token (softmax, or sigmoid as DeepSeek V3 does), each token takes its ``top_k`` experts, the
chosen weights are optionally renormalized to sum to one and scaled by ``routed_scaling_factor``,
and shared experts (one fused SwiGLU of ``num_shared * I_shared`` width) add to every token.
With ``num_groups > 1`` the choice is group-limited as in DeepSeek V3: experts form equal groups,
each group is scored by the sum of its two best (biased) scores, and a token picks its ``top_k``
experts inside its ``topk_groups`` best groups only. DeepSeek V4 adds ``sqrtsoftplus`` scores
(``sqrt(softplus(logit))``), a ``swiglu_limit`` clamping every expert's gate (above) and up
projection (both sides) before the SwiGLU, and hash-routed layers whose experts come from a fixed
``tid2eid[token_id]`` table (:meth:`MoE.forward`'s ``hash_experts``) while the scores still weight them.

Tokens are grouped per expert (a stable sort of the token/expert pairs), so each expert runs one
matmul over exactly the tokens that chose it; no expert runs for a token that did not choose it.
Each group's matmuls take the torch path's row chunks of fixed height (see layers/linear.py), and
a token's expert outputs are summed in ascending expert order whatever its batch, so a token's
output does not depend on the other tokens of the batch on CPUs where that row-chunk property holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from agent_infer.model.layers import native_deepseek, native_ops
from agent_infer.model.layers.linear import ROW_MULTIPLE, pad_rows, row_invariant
from agent_infer.model.layers.norm import RMSNorm

Scoring = Literal["softmax", "sigmoid", "sqrtsoftplus"]


def _param(*shape: int, device: torch.device | None, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


def _swiglu(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float | None = None
) -> torch.Tensor:
    def mlp(h: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(h, gate_up).chunk(2, dim=-1)
        if limit is not None:
            gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return F.linear(F.silu(gate) * up, down)

    return row_invariant(mlp, x)


def expert_mlp(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, limit: float | None = None
) -> torch.Tensor:
    """One expert's SwiGLU over ``x`` rows, row-invariant (a row's output ignores the other rows);
    ``limit`` clamps the gate and up projections as :class:`MoE`'s ``swiglu_limit`` does."""
    return _swiglu(x, gate_up, down, limit)


# Set while an expert-parallel rank builds its model (agent_infer/parallel/expert_loading.py): the
# routed experts' [E, ...] tensors are then made on this device ("meta": shapes, no memory) and the
# rank loads its own expert slots into tensors of its own.
_ROUTED_EXPERT_DEVICE: ContextVar[torch.device | None] = ContextVar("routed_expert_device", default=None)


@contextmanager
def routed_experts_on(device: torch.device) -> Iterator[None]:
    """Build every :class:`MoE` made inside this block with its routed experts on ``device``."""
    token = _ROUTED_EXPERT_DEVICE.set(device)
    try:
        yield
    finally:
        _ROUTED_EXPERT_DEVICE.reset(token)


class ExpertBackend(Protocol):
    """Runs a MoE layer's routed experts elsewhere (expert parallelism, ``agent_infer.parallel``)."""

    def forward(self, moe: MoE, x: torch.Tensor, hash_experts: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for ``x`` ``[T, H]`` (``hash_experts`` as in :meth:`MoE.forward`), as
        :meth:`MoE.forward` would compute it."""
        ...


class MoE(nn.Module):
    """Routed experts (``gate_up`` ``[E, 2I, H]``, ``down`` ``[E, H, I]``) and optional shared experts.

    ``score_bias`` (``[E]``, DeepSeek V3's ``e_score_correction_bias``) shifts which experts are
    chosen but not their weights.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        scoring: Scoring = "softmax",
        renormalize: bool = True,
        routed_scaling_factor: float = 1.0,
        score_bias: bool = False,
        shared_intermediate_size: int = 0,
        num_groups: int = 1,
        topk_groups: int = 1,
        swiglu_limit: float | None = None,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
        if scoring not in ("softmax", "sigmoid", "sqrtsoftplus"):
            raise ValueError(
                f"unknown MoE scoring {scoring!r}; expected 'softmax', 'sigmoid' or 'sqrtsoftplus'"
            )
        if num_groups > 1 and (
            num_experts % num_groups or not 1 <= topk_groups <= num_groups or num_experts // num_groups < 2
        ):
            raise ValueError(
                f"group-limited routing needs num_experts={num_experts} split into num_groups={num_groups} groups "
                f"of >= 2 experts and 1 <= topk_groups={topk_groups} <= num_groups"
            )
        if num_groups > 1 and top_k > topk_groups * (num_experts // num_groups):
            raise ValueError(f"top_k={top_k} exceeds the experts of topk_groups={topk_groups} groups")
        self.num_experts = num_experts
        self.num_groups = num_groups
        self.topk_groups = topk_groups
        self.top_k = top_k
        self.scoring: Scoring = scoring
        self.renormalize = renormalize
        self.routed_scaling_factor = routed_scaling_factor
        self.swiglu_limit = swiglu_limit
        #: Set by expert parallelism: the routed experts then run on other ranks' slots.
        self.expert_backend: ExpertBackend | None = None
        self.router = _param(num_experts, hidden_size, device=device, dtype=dtype)
        self.score_bias = _param(num_experts, device=device, dtype=torch.float32) if score_bias else None
        routed = _ROUTED_EXPERT_DEVICE.get() or device
        self.gate_up = _param(num_experts, 2 * intermediate_size, hidden_size, device=routed, dtype=dtype)
        self.down = _param(num_experts, hidden_size, intermediate_size, device=routed, dtype=dtype)
        self.shared_gate_up = (
            _param(2 * shared_intermediate_size, hidden_size, device=device, dtype=dtype)
            if shared_intermediate_size
            else None
        )
        self.shared_down = (
            _param(hidden_size, shared_intermediate_size, device=device, dtype=dtype)
            if shared_intermediate_size
            else None
        )
        #: The experts and the router on the native kernel once :meth:`pack_experts` ran (float32 CPU models).
        self.packed_experts: native_deepseek.PackedExpertSet | None = None
        self.packed_router: native_deepseek.PackedRouterSet | None = None
        #: The routed experts' packed gate_up and down matrices once their torch copies are dropped.
        self._packed_routed: tuple[list[native_ops.PackedWeight], list[native_ops.PackedWeight]] | None = None
        #: Multiply-adds per token of the packed router and experts (their calls' thread count).
        self._row_work = 0

    def pack_experts(self, pack: Callable[[torch.Tensor], native_ops.PackedWeight]) -> None:
        """Route and run the experts (routed and shared) on the native kernel over ``pack`` of each
        weight matrix from now on: one call per layer, batch invariant without padding rows (see
        ``engine_native/src/kernels/linear_router.h`` and ``linear_moe.h``; ties between equal scores
        go to the lower expert). The routed experts' torch weights are dropped (``meta`` tensors
        keep their shapes), so they are held once; :meth:`routed_weights` reads them back from the
        packed copies (expert parallelism's slots). The router and shared experts keep theirs."""
        gate_up = [pack(self.gate_up[e]) for e in range(self.num_experts)]
        down = [pack(self.down[e]) for e in range(self.num_experts)]
        shared = (
            (pack(self.shared_gate_up), pack(self.shared_down))
            if self.shared_gate_up is not None and self.shared_down is not None
            else (None, None)
        )
        self.packed_experts = native_deepseek.packed_experts(gate_up, down, *shared)
        self._packed_routed = (gate_up, down)
        hidden, inter = int(self.down.shape[1]), int(self.down.shape[2])
        shared_inter = 0 if self.shared_down is None else int(self.shared_down.shape[1])
        self._row_work = (self.num_experts + 3 * (self.top_k * inter + shared_inter)) * hidden
        self.gate_up = nn.Parameter(torch.empty_like(self.gate_up, device="meta"), requires_grad=False)
        self.down = nn.Parameter(torch.empty_like(self.down, device="meta"), requires_grad=False)
        self.pack_router(pack)

    def pack_router(self, pack: Callable[[torch.Tensor], native_ops.PackedWeight]) -> None:
        """Route on the native kernel over ``pack`` of the router (:meth:`pack_experts` without the
        experts: an expert-parallel rank packs its own slots)."""
        bias = None if self.score_bias is None else [float(b) for b in self.score_bias.float().tolist()]
        self.packed_router = native_deepseek.packed_router(
            pack(self.router), self.scoring, bias, self.num_groups, self.topk_groups if self.num_groups > 1 else 1,
            self.top_k,
            self.renormalize, self.routed_scaling_factor,
        )  # fmt: skip

    def dropped_routed_bytes(self) -> int:
        """Bytes of the packed routed experts whose torch copies :meth:`pack_experts` dropped (0 while
        the torch weights are held): what the layer's experts occupy once packed."""
        if self._packed_routed is None:
            return 0
        gate_up, down = self._packed_routed
        return sum(int(w.nbytes) for w in (*gate_up, *down))

    def routed_weights(self, experts: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the routed ``experts``' ``gate_up`` ``[S, 2I, H]`` and ``down`` ``[S, H, I]``:
        from the torch weights, or from the packed ones once :meth:`pack_experts` dropped those."""
        index = list(experts)
        if self._packed_routed is None:
            return self.gate_up.detach()[index].clone(), self.down.detach()[index].clone()
        gate_up, down = self._packed_routed
        dtype = self.gate_up.dtype
        return (
            torch.stack([native_ops.unpack_float(gate_up[e]) for e in index]).to(dtype),
            torch.stack([native_ops.unpack_float(down[e]) for e in index]).to(dtype),
        )

    def route(
        self, x: torch.Tensor, hash_experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token, the chosen experts ``[T, top_k]`` (int64) and their float32 weights ``[T, top_k]``.

        On the CPU every routing op runs on chunks of exactly ROW_MULTIPLE rows (zero-padded), like
        the matmuls: vectorized sigmoid/softmax and the weight sums then see one shape whatever the
        batch, so a token's weights do not depend on it (with 1 row, 8 experts fall in the scalar tail
        of a 16-wide vector loop and round differently). That holds when ``4 * num_experts`` is a
        multiple of the vector width (any expert count divisible by 4). ``hash_experts`` ``[T, top_k]``
        fixes the experts (hash routing); the scores still weight them.
        """
        m = int(x.shape[0])
        if x.device.type != "cpu":
            return self._route_rows(x, hash_experts)
        rows = pad_rows(m)
        if rows > m:
            x = torch.cat((x, x.new_zeros(rows - m, *x.shape[1:])))
            if hash_experts is not None:
                hash_experts = torch.cat((hash_experts, hash_experts.new_zeros(rows - m, self.top_k)))
        parts = [
            self._route_rows(
                x[i : i + ROW_MULTIPLE], None if hash_experts is None else hash_experts[i : i + ROW_MULTIPLE]
            )
            for i in range(0, rows, ROW_MULTIPLE)
        ]
        if len(parts) == 1:
            return parts[0][0][:m], parts[0][1][:m]
        return torch.cat([p[0] for p in parts])[:m], torch.cat([p[1] for p in parts])[:m]

    def _route_rows(
        self, x: torch.Tensor, hash_experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.router).float()
        if self.scoring == "softmax":
            scores = logits.softmax(dim=-1)
        elif self.scoring == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = F.softplus(logits).sqrt()
        if hash_experts is not None:
            experts = hash_experts
        else:
            choice = scores if self.score_bias is None else scores + self.score_bias
            if self.num_groups > 1:
                choice = self._limit_to_groups(choice)
            experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights * self.routed_scaling_factor

    def _limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` with the experts outside each token's ``topk_groups`` best groups set to -inf."""
        tokens = int(choice.shape[0])
        grouped = choice.view(tokens, self.num_groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = group_scores.topk(self.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[:, :, None], float("-inf")).view(tokens, -1)

    def forward_normed(
        self, x: torch.Tensor, norm: RMSNorm, hash_experts: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`forward` of ``norm(x)``; the packed path normalizes inside its kernel call."""
        if self.expert_backend is None and self.packed_experts is not None and self.packed_router is not None:
            out = native_deepseek.run_routed_experts(
                self.packed_experts,
                self.packed_router,
                x,
                hash_experts,
                self.swiglu_limit,
                (norm.weight, norm.eps),
                row_work=self._row_work,
            )
            return out.to(x.dtype)
        if self.expert_backend is not None and self.packed_router is not None:
            # the rows the packed layer would route on (its fused norm), wherever the experts run
            normed = native_deepseek.normed_rows(x, int(self.router.shape[1]), (norm.weight, norm.eps))
            return self.expert_backend.forward(self, normed, hash_experts).to(x.dtype)
        return self.forward(norm.forward(x), hash_experts)

    def forward(self, x: torch.Tensor, hash_experts: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's output for ``x`` ``[T, H]`` (already normalized); ``hash_experts`` ``[T, top_k]``
        (int64) fixes each token's experts instead of the scores' top-k."""
        if self.expert_backend is not None:
            return self.expert_backend.forward(self, x, hash_experts)
        if self.packed_experts is not None and self.packed_router is not None:
            out = native_deepseek.run_routed_experts(
                self.packed_experts,
                self.packed_router,
                x,
                hash_experts,
                self.swiglu_limit,
                row_work=self._row_work,
            )
            return out.to(x.dtype)
        experts, weights = self.route(x, hash_experts)
        flat = experts.reshape(-1)
        order = flat.argsort(stable=True)  # pairs grouped by expert, tokens ascending within each
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        pair_weights = weights.reshape(-1)[order]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        clamp = () if self.swiglu_limit is None else (self.swiglu_limit,)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                rows = tokens[start : start + count]
                y = _swiglu(x.index_select(0, rows), self.gate_up[expert], self.down[expert], *clamp)
                out.index_add_(0, rows, y.float() * pair_weights[start : start + count, None])
            start += count
        if self.shared_gate_up is not None and self.shared_down is not None:
            out += _swiglu(x, self.shared_gate_up, self.shared_down, *clamp).float()
        return out.to(x.dtype)
