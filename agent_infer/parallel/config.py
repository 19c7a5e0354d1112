"""Settings of a data-parallel (attention DP) and expert-parallel deployment."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from agent_infer import envs
from agent_infer.errors import ConfigError

#: Where an EPLB weight move gets an expert this rank lacks: a peer rank holding it (one
#: all-to-all per layer), or the checkpoint's safetensors files (each rank reads its own).
WEIGHT_SOURCES = ("peer", "file")


@dataclass(frozen=True)
class ParallelConfig:
    """How many rank processes serve one model and how its MoE layers are split.

    ``data_parallel_size`` rank processes each run attention, the scheduler, the KV cache and the
    grammar state of their own requests. With ``expert_parallel`` the routed experts of every MoE
    layer are split over the ranks (tokens exchanged all-to-all, ranks stepping in lock-step);
    without it each rank holds every expert and the ranks run independently.

    EPLB: ``redundant_experts`` extra expert slots in total (``(E + redundant) / ranks`` slots per
    rank; must divide), rebalanced every ``eplb_interval`` busy steps (0 = never) from the loads of
    the last ``eplb_window`` steps; ``eplb_profile`` is a saved load profile (``load_stats.py``)
    giving the starting placement; ``num_nodes`` groups the ranks for the hierarchical policy;
    ``eplb_weight_source`` is where a move gets an expert the rank lacks (:data:`WEIGHT_SOURCES`).
    ``collective_timeout_s`` bounds every collective (a dead peer fails the rank, not hangs it);
    ``startup_timeout_s`` bounds loading and joining the group.

    Context parallelism: a prompt with at least ``cp_prefill_threshold`` tokens still to compute
    (None: ``AGENT_INFER_CP_PREFILL_THRESHOLD``; 0: never) is prefilled over all ranks in the
    zig-zag split and decoded by the rank that owns it (``cp_engine.py``; DeepSeek V3 models).
    """

    data_parallel_size: int = 1
    expert_parallel: bool = False
    redundant_experts: int = 0
    eplb_interval: int = 0
    eplb_window: int = 1000
    eplb_profile: str | None = None
    num_nodes: int = 1
    collective_timeout_s: float = 120.0
    startup_timeout_s: float = 600.0
    eplb_weight_source: str = "peer"
    cp_prefill_threshold: int | None = None

    def __post_init__(self) -> None:
        for name, low in (
            ("data_parallel_size", 1),
            ("redundant_experts", 0),
            ("eplb_interval", 0),
            ("eplb_window", 1),
            ("num_nodes", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        if not isinstance(self.expert_parallel, bool):
            raise ConfigError("expert_parallel must be a bool")
        if self.data_parallel_size % self.num_nodes:
            raise ConfigError(
                f"num_nodes={self.num_nodes} does not divide data_parallel_size={self.data_parallel_size}"
            )
        for name in ("collective_timeout_s", "startup_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        cp = self.cp_prefill_threshold
        if cp is not None:
            if isinstance(cp, bool) or not isinstance(cp, int) or cp < 0:
                raise ConfigError(f"cp_prefill_threshold must be an integer >= 0, got {cp!r}")
            if cp and self.data_parallel_size < 2:
                raise ConfigError("cp_prefill_threshold needs data_parallel_size >= 2 (ranks to split over)")
        if self.eplb_weight_source not in WEIGHT_SOURCES:
            raise ConfigError(
                f"eplb_weight_source={self.eplb_weight_source!r}; expected one of {', '.join(WEIGHT_SOURCES)}"
            )
        eplb_set = (
            self.redundant_experts
            or self.eplb_interval
            or self.eplb_profile is not None
            or self.eplb_weight_source != "peer"
        )
        if eplb_set and not self.expert_parallel:
            raise ConfigError(
                "redundant_experts, eplb_interval, eplb_profile and eplb_weight_source need expert_parallel=True"
            )

    @property
    def cp_threshold(self) -> int:
        """Tokens still to compute from which a prompt is prefilled context-parallel (0: never):
        the field, else ``AGENT_INFER_CP_PREFILL_THRESHOLD``; 0 with a single rank."""
        if self.data_parallel_size < 2:
            return 0
        if self.cp_prefill_threshold is not None:
            return self.cp_prefill_threshold
        return envs.cp_prefill_threshold()

    @property
    def enabled(self) -> bool:
        """Whether more than one rank process is asked for (or expert parallelism on one)."""
        return self.data_parallel_size > 1 or self.expert_parallel

    @classmethod
    def split_kwargs(cls, kwargs: dict[str, Any]) -> tuple[ParallelConfig, dict[str, Any]]:
        """This config from the keys of ``kwargs`` that name its fields, and the other keys."""
        names = {f.name for f in dataclasses.fields(cls)}
        mine = {k: v for k, v in kwargs.items() if k in names}
        return cls(**mine), {k: v for k, v in kwargs.items() if k not in names}
