"""Context-parallel prefill in the serving loop: a long prompt prefilled by every rank together.

Before a step chooses its batch (``LLMEngine.before_schedule``) a rank takes each waiting prompt
with at least ``threshold`` tokens still to compute out of its queue, gives it its KV blocks
(``Scheduler.take_waiting``; prefix-cache hits count as computed) and announces a
:class:`PrefillJob` to the front end, which forwards it to every rank, in one order for all. Each
rank runs the jobs in that order: :func:`context_parallel_prefill` of the prompt minus its last
token (zig-zag chunks, log-sum-exp merge; the MoE layers run, or exchange under expert parallelism,
on each rank's own chunks). The owner writes the latent rows into the request's blocks (positions
already in the prefix cache keep their entries) and hands the request back to its scheduler with
all but the last token computed (``Scheduler.resume``): the next step feeds that token as any
prefill chunk, so the first token is sampled under the request's own grammar mask, penalties and
seed, and the request decodes on its owner as usual.

When a job runs: without lock-step (no expert parallelism) a rank runs it as soon as it reads it,
and the prefill's collectives make the ranks wait for each other. Under lock-step each step's
all-gather also carries how many jobs every rank has received, and all ranks run the jobs each of
them has before the step's forward (``lockstep.py``), so a prefill's collectives never interleave
with a step's exchanges.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.engine.sequence import Sequence
from agent_infer.errors import ConfigError
from agent_infer.model.families.deepseek_v3 import DeepseekV3ForCausalLM
from agent_infer.parallel.context_parallel import PrefillResult, context_parallel_prefill


@dataclass(frozen=True)
class PrefillJob:
    """One context-parallel prefill: the owner rank, its request and the tokens to prefill (the
    prompt, with any tokens a grammar fixed at the start, minus the last token)."""

    owner: int
    request_id: str
    token_ids: tuple[int, ...]


@dataclass
class PrefillStats:
    """A rank's share of context-parallel prefills: jobs run, their wall time (the last one's
    too), tokens prefilled, and jobs this rank owned."""

    prefills: int = 0
    seconds: float = 0.0
    last_seconds: float = 0.0
    tokens: int = 0
    owned: int = 0


class ContextParallelPrefill:
    """One rank's side of context-parallel prefill (installs ``engine.before_schedule``)."""

    def __init__(
        self,
        engine: LLMEngine,
        rank: int,
        world_size: int,
        threshold: int,
        announce: Callable[[PrefillJob], None],
        group: dist.ProcessGroup | None = None,
    ) -> None:
        model = engine.runner.model
        if not isinstance(model, DeepseekV3ForCausalLM):
            raise ConfigError(
                f"context-parallel prefill (cp_prefill_threshold={threshold}) needs a DeepSeek V3 (MLA) "
                f"model; {engine.loaded.path} is {engine.loaded.config.architecture}"
            )
        self.engine = engine
        self.model = model
        self.rank = rank
        self.group = group
        # The zig-zag split needs two chunks per rank.
        self.minimum = max(threshold, 2 * world_size)
        self.announce = announce
        #: Requests this rank owns whose prefill job has not run yet.
        self.held: dict[str, Sequence] = {}
        #: Jobs received from the front end, in its order; the first ``done`` have run.
        self.jobs: list[PrefillJob] = []
        self.done = 0
        self.stats = PrefillStats()
        engine.before_schedule = self.pick

    def pick(self) -> None:
        """Take the waiting prompts long enough for a job out of the queue and announce their jobs."""
        engine = self.engine
        scheduler, blocks = engine.scheduler, engine.block_manager
        for seq in list(scheduler.waiting):
            if seq.num_tokens - 1 < self.minimum:
                continue
            if len(scheduler.running) + len(self.held) >= engine.config.max_num_seqs:
                break
            if not blocks.can_allocate(seq):
                break
            scheduler.take_waiting(seq)
            if seq.num_tokens - 1 - seq.num_computed_tokens < self.minimum:
                # Mostly a prefix-cache hit: the rest is a short prefill on this rank.
                scheduler.resume(seq, seq.num_computed_tokens)
                continue
            self.held[seq.request_id] = seq
            self.announce(PrefillJob(self.rank, seq.request_id, tuple(seq.token_ids[: seq.num_tokens - 1])))

    def receive(self, job: PrefillJob) -> None:
        """Queue a job the front end forwarded (every rank gets every job, in the same order)."""
        self.jobs.append(job)

    def run_ready(self, count: int) -> None:
        """Run the received jobs up to the ``count``-th (every rank calls this with the same count)."""
        while self.done < min(count, len(self.jobs)):
            job = self.jobs[self.done]
            self.done += 1
            start = time.perf_counter()
            result = context_parallel_prefill(self.model, list(job.token_ids), self.group)
            if job.owner == self.rank:
                self._adopt(job, result)
            elapsed = time.perf_counter() - start
            s = self.stats
            s.prefills += 1
            s.seconds += elapsed
            s.last_seconds = elapsed
            s.tokens += len(job.token_ids)

    def _adopt(self, job: PrefillJob, result: PrefillResult) -> None:
        """Write the job's latent rows into the owner's paged cache and resume its request."""
        seq = self.held.pop(job.request_id, None)
        if seq is None or seq.is_finished:  # aborted meanwhile: its blocks are already freed
            return
        self.stats.owned += 1
        n = len(job.token_ids)
        cached = seq.num_computed_tokens
        runner = self.engine.runner
        bs, table = runner.block_size, seq.block_table
        slots = torch.tensor(
            [table[p // bs] * bs + p % bs for p in range(cached, n)], dtype=torch.int64, device=runner.device
        )
        for layer, rows in enumerate(result.latents):
            cache = runner.kv_cache.latent(layer)
            cache.index_copy_(0, slots, rows[cached:n].to(cache.dtype))
        keep = runner.keep_hidden
        if keep is not None and keep(seq):
            # The MTP module reads the main model's hidden rows of every committed position.
            seq.spec.add_mtp_rows(cached, result.hidden[cached:n])
        self.engine.scheduler.resume(seq, n)
