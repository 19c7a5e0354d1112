"""Real ``torch.distributed`` rank processes for the parallel tests (gloo on loopback), bounded by a
timeout so a broken collective fails the test instead of hanging it."""

from __future__ import annotations

import pickle
import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from agent_infer.accelerator import get_accelerator
from agent_infer.parallel.group import GroupSpec, close_group, free_port, init_group

CPU = get_accelerator("cpu")


def _entry(target: Callable[..., Any], rank: int, spec: GroupSpec, args: tuple[Any, ...], out: Any) -> None:
    torch.set_num_threads(1)
    try:
        init_group(spec, rank, CPU)
        # Plain pickle bytes: a tensor through an mp queue is shared by file descriptor, which
        # dies with this process.
        out.put((rank, "ok", pickle.dumps(target(rank, spec.world_size, *args))))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))
    finally:
        close_group()


def run_ranks(target: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """``target(rank, world_size, *args)`` in ``world_size`` spawned processes in one gloo group;
    their results in rank order. A rank's exception or the timeout fails the call (all killed)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    spec = GroupSpec(world_size, "127.0.0.1", free_port(), timeout_s=timeout)
    procs = [
        ctx.Process(target=_entry, args=(target, r, spec, args, out), daemon=True) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < world_size:
            try:
                rank, status, value = out.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"ranks did not finish within {timeout}s") from None
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]
