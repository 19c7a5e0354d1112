"""Parallel MoE serving: attention data parallelism over rank processes, expert parallelism with
EPLB placements, and balanced context-parallel prefill (see docs/parallel.md)."""

from agent_infer.parallel.config import ParallelConfig
from agent_infer.parallel.launch import DataParallelEngine

__all__ = ["DataParallelEngine", "ParallelConfig"]
