"""The dense gated MLP: ``down(act(gate(x)) * up(x))`` with gate and up fused in one projection.

``act`` is SiLU (SwiGLU, the default) or tanh-approximated GELU (GeGLU, Gemma), by the HF
``hidden_activation`` name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from agent_infer.errors import UnsupportedModelError
from agent_infer.model.layers.linear import Linear, LinearBuilder, WeightPart
from agent_infer.model.layers.norm import RMSNorm


class FeedForward(Protocol):
    """A decoder block's feed-forward, dense or mixture of experts."""

    def forward(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """The feed-forward of ``norm(x)``."""
        ...

    def load_targets(self) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]:
        """HF name -> (destination, first row in it, expected shape) of the tensors loaded by name."""
        ...


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


#: HF ``hidden_activation``/``hidden_act`` names -> the gate's activation.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": _gelu_tanh,
}


class GatedMLP(nn.Module):
    """Gated MLP over two projections from the model's :class:`LinearBuilder`.

    ``prefix`` is the HF name prefix of its tensors (``model.layers.3.mlp.``); ``activation`` a key
    of :data:`ACTIVATIONS`.
    """

    def __init__(
        self,
        linears: LinearBuilder,
        prefix: str,
        hidden_size: int,
        intermediate_size: int,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"unsupported MLP activation {activation!r}; supported: {', '.join(ACTIVATIONS)}"
            )
        self.act = ACTIVATIONS[activation]
        self.gate_up: Linear = linears.linear(
            [
                WeightPart(prefix + "gate_proj.weight", intermediate_size),
                WeightPart(prefix + "up_proj.weight", intermediate_size),
            ],
            hidden_size,
        )
        self.down: Linear = linears.linear(
            [WeightPart(prefix + "down_proj.weight", hidden_size)], intermediate_size
        )

    def forward(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        """The MLP of ``norm(x)`` (the norm fused into the gate/up call where the kernel can)."""
        gate, up = self.gate_up.project_normed(x, norm).chunk(2, dim=-1)
        return self.down.project(self.act(gate) * up)

    def load_targets(self) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]:
        """The gate/up and down tensors still loaded by name (none when packed)."""
        return {**self.gate_up.load_targets(), **self.down.load_targets()}
