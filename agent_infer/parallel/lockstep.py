"""Lock-step of expert-parallel ranks: every rank takes part in every step's MoE exchanges.

Each rank's engine calls :class:`LockStep` with its scheduled batch before running it. The ranks
all-gather ``(busy, stop, tokens, prefill jobs received)`` and run the context-parallel prefill
jobs every rank has received (``cp_engine.py``); when any rank is busy, every rank runs the step's exchanges,
an idle one through an empty pass of the MoE layers (as vLLM and SGLang do for DP attention), so
the collectives line up. Every ``eplb_interval`` busy steps the ranks sum their expert loads,
compute the same EPLB placement and move expert weights before the step's forward; requests wait
for that one step only. A stop asked of any rank stops all of them at the same step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from agent_infer.engine.scheduler import ScheduledSequence
from agent_infer.parallel.config import ParallelConfig
from agent_infer.parallel.cp_engine import ContextParallelPrefill
from agent_infer.parallel.eplb import balanced_placement
from agent_infer.parallel.expert_loading import ReadStats
from agent_infer.parallel.expert_parallel import ExpertParallel


class StopLockStep(Exception):
    """Raised out of the engine's step on every rank once any rank asked to stop."""


@dataclass
class ParallelMetrics:
    """What a rank reports: per-rank tokens of the last busy step, totals, EPLB history."""

    rank: int
    steps: int = 0
    idle_steps: int = 0
    tokens_per_rank: list[int] = field(default_factory=list)
    total_tokens_per_rank: list[int] = field(default_factory=list)
    dispatch_bytes: int = 0
    rebalances: int = 0
    rebalance_bytes: int = 0
    rebalance_seconds: float = 0.0
    #: Wall time of busy steps on this rank, and the MoE layers' share of it: waiting for the
    #: other ranks (count exchange), moving rows, running the local experts, idle passes.
    step_seconds: float = 0.0
    wait_seconds: float = 0.0
    transfer_seconds: float = 0.0
    expert_seconds: float = 0.0
    idle_pass_seconds: float = 0.0
    #: Per rebalance, the expert imbalance (max/mean rank load, averaged over MoE layers) of the
    #: window's load under the placement it replaced and under the new one.
    imbalance_history: list[tuple[float, float]] = field(default_factory=list)
    #: Each MoE layer's current placement (logical expert of every physical slot).
    placements: list[tuple[int, ...]] = field(default_factory=list)
    #: Bytes of weights this rank holds (replicated parts plus its expert slots), at start.
    weight_bytes: int = 0
    #: Per MoE layer, the logical experts whose tensors this rank read from the checkpoint (at
    #: load and by file-sourced weight moves), and those reads' bytes; empty for a GGUF model
    #: (loaded whole).
    experts_read: list[list[int]] = field(default_factory=list)
    expert_bytes_read: int = 0

    @property
    def dispatch_bytes_per_step(self) -> float:
        """All-to-all bytes this rank sent per busy step."""
        return self.dispatch_bytes / self.steps if self.steps else 0.0


class LockStep:
    """The step hook of one expert-parallel rank (``LLMEngine.step_hook``)."""

    def __init__(
        self,
        ep: ExpertParallel,
        config: ParallelConfig,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        num_groups: int = 1,
    ) -> None:
        self.ep = ep
        self.config = config
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.num_groups = num_groups
        self.stop_requested = False
        self.any_busy = False
        #: What the rank read of the checkpoint's experts (None when it loaded a GGUF whole).
        self.read_stats: ReadStats | None = None
        #: Context-parallel prefill jobs, run when every rank has received them (None: off).
        self.cp: ContextParallelPrefill | None = None
        self._last_step = time.perf_counter()
        world = ep.world_size
        self.metrics = ParallelMetrics(
            ep.rank,
            tokens_per_rank=[0] * world,
            total_tokens_per_rank=[0] * world,
            placements=[p.slots for p in ep.placements],
        )

    def __call__(self, scheduled: list[ScheduledSequence]) -> None:
        tokens = sum(item.num_new_tokens + len(item.draft) for item in scheduled)
        jobs = len(self.cp.jobs) if self.cp is not None else 0
        mine = torch.tensor(
            [int(bool(scheduled)), int(self.stop_requested), tokens, jobs],
            dtype=torch.int64,
            device=self.ep.device,
        )
        gathered = [torch.empty_like(mine) for _ in range(self.ep.world_size)]
        dist.all_gather(gathered, mine, group=self.ep.group)
        table = torch.stack(gathered).cpu()
        if bool(table[:, 1].any()):
            raise StopLockStep
        if self.cp is not None:
            # The jobs every rank has received; the same count on every rank.
            self.cp.run_ready(int(table[:, 3].min()))
        was_busy, self.any_busy = self.any_busy, bool(table[:, 0].any())
        now = time.perf_counter()
        m = self.metrics
        if was_busy:
            m.step_seconds += now - self._last_step
        self._last_step = now
        if not self.any_busy:
            return
        m.steps += 1
        m.tokens_per_rank = table[:, 2].tolist()
        m.total_tokens_per_rank = [a + b for a, b in zip(m.total_tokens_per_rank, m.tokens_per_rank)]
        self.ep.load.advance()
        interval = self.config.eplb_interval
        if interval and m.steps % interval == 0:
            self.rebalance()
        if not scheduled:
            m.idle_steps += 1
            start = time.perf_counter()
            self.ep.idle_pass(self.hidden_size, self.dtype, self.device)
            m.idle_pass_seconds += time.perf_counter() - start
        stats = self.ep.stats
        m.dispatch_bytes = stats.dispatch_bytes
        m.wait_seconds, m.transfer_seconds = stats.wait_seconds, stats.transfer_seconds
        m.expert_seconds = stats.expert_seconds

    def rebalance(self) -> None:
        """Compute the EPLB placement of the window's summed loads and move the weights to it."""
        start = time.perf_counter()
        load = self.ep.global_load()
        old = self.ep.placements
        new = [
            balanced_placement(
                load[i].tolist(),
                p.num_ranks,
                p.slots_per_rank,
                num_groups=self.num_groups,
                num_nodes=self.config.num_nodes,
            )
            for i, p in enumerate(old)
        ]
        m = self.metrics
        before = _mean([p.imbalance(load[i].tolist()) for i, p in enumerate(old)])
        after = _mean([p.imbalance(load[i].tolist()) for i, p in enumerate(new)])
        m.imbalance_history.append((before, after))
        self.ep.rebalance(new)
        m.placements = [p.slots for p in new]
        self.record_reads()
        m.rebalances += 1
        m.rebalance_bytes = self.ep.stats.rebalance_bytes
        m.rebalance_seconds += time.perf_counter() - start

    def record_reads(self) -> None:
        """Copy the checkpoint read counts into the metrics."""
        reads = self.read_stats
        if reads is not None:
            self.metrics.experts_read = [sorted(e) for e in reads.experts_read]
            self.metrics.expert_bytes_read = reads.expert_bytes_read


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
