"""One rank process: its own engine (scheduler, KV cache, grammar state) driven by the front end.

The front end sends ``("add", id, prompt, params)``, ``("abort", id)``, ``("cp", job)`` (a
context-parallel prefill every rank joins) and ``("stop",)`` on the rank's inbox; the rank answers
on the shared outbox with ``("ready", rank, info)``, ``("ack", rank, id, error, warnings)``,
``("status", rank, counts)``, ``("out", rank, outputs)``, ``("metrics", rank, metrics)``,
``("cp", rank, job)`` (a job it announces) and, when it fails, ``("error", rank, text)``.
Expert-parallel ranks step in lock-step (``lockstep.py``) and so poll rather than block while all
of them are idle.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import queue
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from agent_infer import envs
from agent_infer.accelerator import get_accelerator
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.errors import ConfigError, EngineError, InvalidRequestError
from agent_infer.model.layers.moe import MoE
from agent_infer.parallel.config import ParallelConfig
from agent_infer.parallel.cp_engine import ContextParallelPrefill
from agent_infer.parallel.eplb import Placement, balanced_placement, contiguous_placement
from agent_infer.parallel.expert_loading import RankWeights, load_rank_weights, resident_weight_bytes
from agent_infer.parallel.expert_parallel import ExpertParallel
from agent_infer.parallel.group import GroupSpec, close_group, init_group, pin_rank_device
from agent_infer.parallel.load_stats import load_profile
from agent_infer.parallel.lockstep import LockStep, StopLockStep

# How long an idle rank waits for a command. Lock-step ranks that are all idle sleep between polls,
# from the shortest to the longest pause as the idle spell lasts (a new request waits at most the
# longest; an idle server costs a collective per pause).
_IDLE_POLL_S = 0.002
_IDLE_POLL_MAX_S = 0.02
_METRICS_EVERY_S = 0.5
_STATUS_EVERY_S = 0.25


def rank_main(
    rank: int,
    spec: GroupSpec,
    model: str | None,
    engine_config: EngineConfig,
    config: ParallelConfig,
    inbox: Any,
    outbox: Any,
) -> None:
    """The rank process's entry point (spawned by the front end)."""
    try:
        if not envs.num_threads():
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
        pin_rank_device(get_accelerator(engine_config.accelerator), rank, spec.world_size)
        lock: LockStep | None = None
        if config.expert_parallel:
            accelerator = get_accelerator(engine_config.accelerator)
            weights = load_rank_weights(
                model,
                accelerator.device,
                engine_config.torch_dtype,
                rank,
                lambda moes: _placements(moes, config, spec.world_size),
            )
            engine = LLMEngine(None, engine_config, loaded=weights.loaded)
            init_group(spec, rank, engine.accelerator)
            lock = _expert_parallel(engine, weights, config, rank, spec.world_size)
        else:
            engine = LLMEngine(model, engine_config)
            init_group(spec, rank, engine.accelerator)
        cp = None
        if config.cp_threshold:
            cp = ContextParallelPrefill(
                engine,
                rank,
                spec.world_size,
                config.cp_threshold,
                lambda job: outbox.put(("cp", rank, job)),
            )
            if lock is not None:
                lock.cp = cp
        info = {
            "tokenizer": engine.tokenizer if rank == 0 else None,
            "max_model_len": engine.max_model_len,
            "vocab_size": engine.vocab_size,
            "eos_token_ids": engine.eos_token_ids,
            "path": str(engine.loaded.path),
        }
        outbox.put(("ready", rank, info))
        held = lock.metrics.weight_bytes if lock is not None else resident_weight_bytes(engine.runner.model)
        _loop(_Rank(rank, engine, lock, cp, inbox, outbox, held))
    except BaseException:
        outbox.put(("error", rank, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        close_group()


def _placements(moes: list[MoE], config: ParallelConfig, world: int) -> list[Placement]:
    """Each MoE layer's starting placement: balanced for the saved profile, else contiguous."""
    experts = moes[0].num_experts
    total = experts + config.redundant_experts
    if total % world:
        raise ConfigError(
            f"{experts} experts + {config.redundant_experts} redundant = {total} slots do not split "
            f"evenly over {world} ranks"
        )
    slots = total // world
    if config.eplb_profile is None:
        return [contiguous_placement(experts, world, slots) for _ in moes]
    load = load_profile(config.eplb_profile, len(moes), experts)
    return [
        balanced_placement(
            load[i].tolist(), world, slots, num_groups=moes[0].num_groups, num_nodes=config.num_nodes
        )
        for i in range(len(moes))
    ]


def _expert_parallel(
    engine: LLMEngine, weights: RankWeights, config: ParallelConfig, rank: int, world: int
) -> LockStep:
    fetch = None
    if config.eplb_weight_source == "file":
        checkpoint = weights.checkpoint
        if checkpoint is None:
            raise ConfigError(
                f"eplb_weight_source='file' needs a safetensors checkpoint folder; {engine.loaded.path} is not one"
            )
        device = engine.accelerator.device
        fetch = lambda layer, expert: checkpoint.read_expert(layer, expert, device)  # noqa: E731
    ep = ExpertParallel(
        weights.moes,
        weights.placements,
        rank=rank,
        world_size=world,
        window=config.eplb_window,
        slots=weights.slots,
        fetch=fetch,
    )
    c = engine.loaded.config
    lock = LockStep(
        ep,
        config,
        hidden_size=c.hidden_size,
        dtype=engine.config.torch_dtype,
        device=engine.accelerator.device,
        num_groups=weights.moes[0].num_groups,
    )
    lock.metrics.weight_bytes = resident_weight_bytes(engine.runner.model, ep.slot_sets())
    if weights.checkpoint is not None:
        lock.read_stats = weights.checkpoint.stats
        lock.record_reads()
    engine.step_hook = lock
    return lock


@dataclass
class _Rank:
    """A rank process's state: its engine, lock-step (expert parallelism), context-parallel
    prefill, and its queues to and from the front end."""

    rank: int
    engine: LLMEngine
    lock: LockStep | None
    cp: ContextParallelPrefill | None
    inbox: Any
    outbox: Any
    #: Bytes of weights the rank holds (its expert slots only, under expert parallelism).
    weight_bytes: int


def _status(r: _Rank) -> dict[str, Any]:
    """What the server's snapshot shows of this rank: queue lengths, KV blocks, grammar timings,
    context-parallel prefills."""
    engine = r.engine
    s = engine.scheduler
    return {
        "waiting": len(s.waiting) + (len(r.cp.held) if r.cp is not None else 0),
        "waiting_for_grammar": len(s.waiting_for_grammar),
        "running": len(s.running),
        "prompt_tokens_computed": s.num_prompt_tokens_computed,
        "kv_blocks_total": engine.block_manager.num_blocks,
        "kv_blocks_free": engine.block_manager.num_free_blocks,
        "grammar": engine.grammar.timings(),
        "cp_prefill": dataclasses.replace(r.cp.stats) if r.cp is not None else None,
        "weight_bytes": r.weight_bytes,
    }


def _loop(r: _Rank) -> None:
    engine, lock = r.engine, r.lock
    last_metrics = last_status = 0.0
    pause = _IDLE_POLL_S
    while True:
        now = time.monotonic()
        if now - last_status > _STATUS_EVERY_S:
            r.outbox.put(("status", r.rank, _status(r)))
            last_status = now
        idle = lock is None and not engine.has_unfinished_requests()
        if not _commands(r, wait=_IDLE_POLL_S * 25 if idle else 0.0):
            return
        if lock is None and r.cp is not None:
            # Without lock-step a job runs as soon as it is read; its collectives pair the ranks.
            r.cp.run_ready(len(r.cp.jobs))
        if lock is None and not engine.has_unfinished_requests():
            continue
        try:
            outputs = engine.step()
        except StopLockStep:
            return
        if lock is not None and lock.ep.broken is not None:
            # The step's outputs carry the exchange's error per request; the front end fails them
            # all with RankFailedError instead.
            raise EngineError(f"expert-parallel exchange failed: {lock.ep.broken}")
        if outputs:
            r.outbox.put(("out", r.rank, outputs))
            if any(out.finished for out in outputs):
                # The front end's snapshot must count a finished request's work (its prompt tokens,
                # a context-parallel prefill) even if the rank then idles between status reports.
                r.outbox.put(("status", r.rank, _status(r)))
                last_status = time.monotonic()
        if lock is not None:
            now = time.monotonic()
            if now - last_metrics > _METRICS_EVERY_S:
                r.outbox.put(("metrics", r.rank, lock.metrics))
                last_metrics = now
            if not lock.any_busy and not engine.has_unfinished_requests():
                time.sleep(pause)
                pause = min(2 * pause, _IDLE_POLL_MAX_S)
            else:
                pause = _IDLE_POLL_S


def _commands(r: _Rank, wait: float) -> bool:
    """Apply the queued commands; False once this rank should stop (lock-step ranks stop together)."""
    engine, lock, rank, outbox = r.engine, r.lock, r.rank, r.outbox
    while True:
        try:
            command = r.inbox.get(timeout=wait) if wait else r.inbox.get_nowait()
        except queue.Empty:
            return True
        wait = 0.0
        kind = command[0]
        if kind == "stop":
            if lock is None:
                return False
            lock.stop_requested = True
        elif kind == "cp" and r.cp is not None:
            r.cp.receive(command[1])
        elif kind == "metrics":
            outbox.put(("metrics", rank, lock.metrics if lock is not None else None))
        elif kind == "load":
            load = lock.ep.load.totals() if lock is not None else None
            outbox.put(("load", rank, load))
        elif kind == "abort":
            engine.abort(command[1])
        elif kind == "add":
            _, request_id, prompt, params = command
            try:
                engine.add_request(request_id, prompt, params)
                warnings = engine.requests[request_id].constraint_warnings
                outbox.put(("ack", rank, request_id, None, warnings))
            except Exception as exc:
                outbox.put(("ack", rank, request_id, _portable(exc), ()))


def _portable(exc: Exception) -> Exception:
    """``exc`` if it survives pickling to the front end, else an InvalidRequestError with its text."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return InvalidRequestError(f"{type(exc).__name__}: {exc}")
