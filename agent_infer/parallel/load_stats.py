"""Per-expert token counts over a sliding window of engine steps, and saved load profiles.

Each MoE layer adds the tokens its router sent to each logical expert during the current step;
:meth:`ExpertLoad.advance` closes the step. The window keeps the last ``window`` steps, so a
rebalance follows the recent traffic rather than the whole history. A profile (JSON, one list of
per-expert loads per MoE layer) lets a deployment start from a static placement measured earlier.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from agent_infer.errors import ConfigError


class ExpertLoad:
    """Token counts ``[window, layers, experts]`` (int64, a ring over steps)."""

    def __init__(self, num_layers: int, num_experts: int, window: int) -> None:
        if window < 1:
            raise ConfigError(f"the EPLB window must be >= 1 step, got {window}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.window = window
        self._counts = torch.zeros(window, num_layers, num_experts, dtype=torch.int64)
        self._slot = 0

    def record(self, layer: int, experts: torch.Tensor) -> None:
        """Count the chosen experts ``[T, top_k]`` of MoE layer ``layer`` (0-based among MoE layers)."""
        if experts.numel():
            self._counts[self._slot, layer] += torch.bincount(
                experts.reshape(-1).cpu(), minlength=self.num_experts
            )

    def advance(self) -> None:
        """Close the current step; the oldest one in the window is forgotten."""
        self._slot = (self._slot + 1) % self.window
        self._counts[self._slot].zero_()

    def totals(self) -> torch.Tensor:
        """Counts summed over the window, ``[layers, experts]``."""
        return self._counts.sum(dim=0)

    def last_step(self) -> torch.Tensor:
        """Counts of the step being recorded, ``[layers, experts]``."""
        return self._counts[self._slot].clone()


def save_profile(path: str | Path, loads: torch.Tensor) -> None:
    """Write per-layer expert loads ``[layers, experts]`` as a JSON profile."""
    Path(path).write_text(json.dumps({"expert_load": loads.tolist()}), encoding="utf-8")


def load_profile(path: str | Path, num_layers: int, num_experts: int) -> torch.Tensor:
    """Read a profile written by :func:`save_profile`; raises :class:`ConfigError` naming what does
    not fit the model (the file, its shape, a negative load)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        loads = torch.tensor(data["expert_load"], dtype=torch.float64)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"EPLB profile {path}: cannot read an 'expert_load' table ({exc})") from exc
    if tuple(loads.shape) != (num_layers, num_experts):
        raise ConfigError(
            f"EPLB profile {path}: expert_load has shape {tuple(loads.shape)}, the model needs "
            f"({num_layers}, {num_experts})"
        )
    if bool((loads < 0).any()):
        raise ConfigError(f"EPLB profile {path}: expert loads must be >= 0")
    return loads
