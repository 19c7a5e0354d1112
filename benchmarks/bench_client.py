"""Client overhead and batching, measured against the engine's own ``LLM.chat`` in the same run.

Run: ``OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_client.py [--reps 5] [--batch 8]``.

1. ``Client.generate(schema=Pet)`` vs ``LLM.chat(..., SamplingParams(structured=Pet))``: one request,
   same engine, same greedy output (the engine request carries the SDK's default loop control, so
   both do the same work); the ratio is what the client layer (request building, grammar cache,
   stepping thread, validation) costs on top of the engine.
2. ``AsyncClient``: ``--batch`` concurrent ``generate(choice=...)`` calls with ``asyncio.gather``
   vs the same calls one after another on ``Client``; the ratio is what batching in the engine buys.
Medians over ``--reps`` repetitions.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, Field

from agent_infer import LLM, AsyncClient, Client, SamplingParams
from agent_infer.client import STRUCTURED_LOOP_CONTROL


class Pet(BaseModel):
    name: str = Field(max_length=20)
    species: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)


PROMPT = "Describe a pet as JSON."


def median_seconds(fn: Callable[[], Any], reps: int) -> float:
    """Median wall time of ``fn`` over ``reps`` runs (after one warm-up run)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    """Print both comparisons as medians and ratios."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()

    llm = LLM()
    client = Client.from_llm(llm)
    loop = STRUCTURED_LOOP_CONTROL.sampling_fields()
    params = SamplingParams(temperature=0, max_tokens=512, structured=Pet, **loop)
    messages = [{"role": "user", "content": PROMPT}]
    assert llm.chat(messages, params)[0].outputs[0].parsed == client.generate(PROMPT, schema=Pet)

    engine_s = median_seconds(lambda: llm.chat(messages, params), args.reps)
    client_s = median_seconds(lambda: client.generate(PROMPT, schema=Pet), args.reps)
    print(
        f"generate(schema=Pet): LLM.chat {engine_s * 1000:.1f} ms, Client {client_s * 1000:.1f} ms, ratio {client_s / engine_s:.3f}"
    )

    aclient = AsyncClient(engine=llm.engine)
    prompts = [
        f"Review {i}: {'great' if i % 2 else 'awful'} product. Good or bad?" for i in range(args.batch)
    ]

    def sequential() -> None:
        for p in prompts:
            client.generate(p, choice=["good", "bad"])

    def batched() -> None:
        async def run() -> None:
            await asyncio.gather(*(aclient.generate(p, choice=["good", "bad"]) for p in prompts))

        asyncio.run(run())

    seq_s = median_seconds(sequential, args.reps)
    bat_s = median_seconds(batched, args.reps)
    print(
        f"{args.batch} choice calls: sequential {seq_s * 1000:.1f} ms, asyncio.gather {bat_s * 1000:.1f} ms, speed-up {seq_s / bat_s:.2f}x"
    )


if __name__ == "__main__":
    main()
