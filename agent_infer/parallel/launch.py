"""The data-parallel front end: N rank processes behind the ``LLMEngine`` request API.

:class:`DataParallelEngine` spawns ``data_parallel_size`` rank processes (``worker.py``, torch
multiprocessing with the spawn start method; the rendezvous is exported as torchrun's variables),
sends each new request to the rank with the fewest unfinished requests (ties to the lower rank,
SGLang's shortest-queue policy), and merges the ranks' outputs. A rank that exits or fails makes
the engine unhealthy: a log line names it, its unfinished requests (every rank's, under expert
parallelism or context-parallel prefill, whose collectives cannot go on without it) end with
``finish_reason == "error"`` and a :class:`RankFailedError` text, the survivors of such a group
are stopped, and new requests raise :class:`RankFailedError`. A context-parallel prefill job a rank
announces is forwarded to every rank, in one order for all of them (``cp_engine.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import time
import weakref
from typing import Any

import torch
import torch.multiprocessing as mp

from agent_infer.engine.config import EngineConfig
from agent_infer.engine.llm_engine import Prompt
from agent_infer.engine.output import CompletionOutput, RequestMetrics, RequestOutput
from agent_infer.errors import ConfigError, InvalidRequestError, RankFailedError
from agent_infer.parallel.config import ParallelConfig
from agent_infer.parallel.group import GroupSpec, free_port
from agent_infer.parallel.load_stats import save_profile
from agent_infer.parallel.lockstep import ParallelMetrics
from agent_infer.parallel.worker import rank_main
from agent_infer.sampling_params import SamplingParams
from agent_infer.structured import StructuredOutput

logger = logging.getLogger("agent_infer.parallel")

# How long step() waits for a rank's output when none is buffered (keeps LLM's drain loop idle-cheap).
_STEP_WAIT_S = 0.05
# How long a rank's failure report waits for a peer's exit to show (the likelier root cause).
_PEER_EXIT_GRACE_S = 1.0


class DataParallelEngine:
    """``add_request`` / ``abort`` / ``step`` / ``has_unfinished_requests`` over N rank processes.

    Construction blocks until every rank has loaded the model and joined the group (at most
    ``parallel.startup_timeout_s``); a rank that fails to start raises :class:`RankFailedError`
    with its error. Call :meth:`shutdown` (or use ``LLM.close``) to stop the ranks.
    """

    def __init__(self, model: str | None, config: EngineConfig, parallel: ParallelConfig) -> None:
        self.config = config
        # The environment's threshold is read once, here, and handed to every rank.
        parallel = dataclasses.replace(parallel, cp_prefill_threshold=parallel.cp_threshold)
        self.parallel = parallel
        n = parallel.data_parallel_size
        ctx = mp.get_context("spawn")
        self._outbox: Any = ctx.Queue()
        self._inboxes: list[Any] = [ctx.Queue() for _ in range(n)]
        spec = GroupSpec(n, "127.0.0.1", free_port(), parallel.collective_timeout_s)
        self._procs = [
            ctx.Process(
                target=rank_main,
                args=(r, spec, model, config, parallel, self._inboxes[r], self._outbox),
                name=f"agent-infer-rank-{r}",
                daemon=True,
            )
            for r in range(n)
        ]
        self._finalizer = weakref.finalize(self, _terminate, self._procs, self._inboxes)
        self._owner: dict[str, int] = {}
        self._models: dict[str, Any] = {}
        self._acks: dict[str, BaseException | None] = {}
        self._loads: dict[int, torch.Tensor] = {}
        #: Each rank's latest queue lengths, KV blocks and grammar timings (reported every 0.25 s).
        self.rank_status: dict[int, dict[str, Any]] = {}
        #: Warnings of each unfinished request's constraint (what ``Sequence.constraint_warnings`` holds).
        self.constraint_warnings: dict[str, tuple[Any, ...]] = {}
        self._buffer: list[RequestOutput] = []
        self._dead: set[int] = set()
        self._stopping = False
        self._healthy = True
        #: Latest lock-step metrics of each rank (None without expert parallelism).
        self.rank_metrics: dict[int, ParallelMetrics | None] = {}
        #: Tokens each rank generated (from its outputs).
        self.generated_tokens = [0] * n
        self._seen_tokens: dict[str, int] = {}
        for p in self._procs:
            p.start()
        info = self._wait_ready(parallel.startup_timeout_s)
        self.tokenizer = info["tokenizer"]
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self.eos_token_ids: frozenset[int] = info["eos_token_ids"]
        self.model_path: str = info["path"]

    @property
    def _coupled(self) -> bool:
        """Whether the ranks run collectives together (expert parallelism or context-parallel
        prefill), so that one rank's death breaks them all."""
        return self.parallel.expert_parallel or bool(self.parallel.cp_threshold)

    @property
    def world_size(self) -> int:
        """The number of rank processes."""
        return len(self._procs)

    @property
    def pids(self) -> list[int | None]:
        """The rank processes' ids, in rank order."""
        return [p.pid for p in self._procs]

    def _wait_ready(self, timeout: float) -> dict[str, Any]:
        ready: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout
        while len(ready) < self.world_size:
            try:
                kind, rank, *rest = self._outbox.get(timeout=0.2)
            except queue.Empty:
                kind, rank, rest = "", -1, []
            if kind == "ready":
                ready[rank] = rest[0]
            elif kind == "error":
                self.shutdown()
                raise RankFailedError(f"rank {rank} failed to start:\n{rest[0]}", rank=rank)
            for r, p in enumerate(self._procs):
                if p.exitcode is not None and r not in ready:
                    self.shutdown()
                    raise RankFailedError(f"rank {r} exited with code {p.exitcode} while starting", rank=r)
            if time.monotonic() > deadline:
                self.shutdown()
                raise RankFailedError(f"the ranks did not start within {timeout}s")
        return ready[0]

    # --- requests ----------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> None:
        """Queue a request on the least-loaded rank; raises what ``LLMEngine.add_request`` raises, and
        :class:`RankFailedError` once the engine is unhealthy."""
        self._check_healthy()
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError("request_id must be a non-empty string", field="request_id")
        if request_id in self._owner:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", field="request_id")
        if params is not None and not isinstance(params, SamplingParams):
            raise InvalidRequestError("params must be a SamplingParams", field="params")
        wire, model = _to_wire(params)
        load = self.requests_per_rank()
        rank = min((r for r in range(self.world_size) if r not in self._dead), key=lambda r: (load[r], r))
        # Owned before the acknowledgement: the rank's first outputs may follow it in the same pump.
        self._owner[request_id] = rank
        if model is not None:
            self._models[request_id] = model
        self._inboxes[rank].put(("add", request_id, prompt, wire))
        try:
            while request_id not in self._acks:
                self._pump(_STEP_WAIT_S)
                self._check_healthy()
        except RankFailedError:
            # Raised here instead of reported as this request's output.
            self._buffer = [out for out in self._buffer if out.request_id != request_id]
            self._forget(request_id)
            raise
        error = self._acks.pop(request_id)
        if error is not None:
            self._forget(request_id)
            raise error

    def _forget(self, request_id: str) -> None:
        for table in (self._owner, self._models, self._seen_tokens, self.constraint_warnings, self._acks):
            table.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Stop a request; its final output comes from a later :meth:`step`."""
        rank = self._owner.get(request_id)
        if rank is not None and rank not in self._dead:
            self._inboxes[rank].put(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        """True while any request runs on a rank or has an undelivered output."""
        return bool(self._owner) or bool(self._buffer)

    def step(self) -> list[RequestOutput]:
        """The outputs the ranks produced since the last call (waits briefly when there are none)."""
        if not self._buffer:
            self._pump(_STEP_WAIT_S)
        out, self._buffer = self._buffer, []
        return out

    def collect_metrics(self, timeout: float = 30.0) -> dict[int, ParallelMetrics | None]:
        """Each live rank's current lock-step metrics (None for a rank without expert parallelism)."""
        self._check_healthy()
        self.rank_metrics.clear()
        for inbox in self._inboxes:
            inbox.put(("metrics",))
        deadline = time.monotonic() + timeout
        while len(self.rank_metrics) < self.world_size:
            self._pump(_STEP_WAIT_S)
            self._check_healthy()
            if time.monotonic() > deadline:
                raise RankFailedError(f"the ranks did not report metrics within {timeout}s")
        return dict(self.rank_metrics)

    def save_load_profile(self, path: str, timeout: float = 30.0) -> torch.Tensor:
        """Write the expert loads of the ranks' windows, summed, as an EPLB profile (``eplb_profile``
        of a later deployment starts from its placement); returns them ``[moe_layers, experts]``."""
        if not self.parallel.expert_parallel:
            raise ConfigError("a load profile needs expert_parallel=True (the ranks count expert loads)")
        self._check_healthy()
        self._loads.clear()
        for inbox in self._inboxes:
            inbox.put(("load",))
        deadline = time.monotonic() + timeout
        while len(self._loads) < self.world_size:
            self._pump(_STEP_WAIT_S)
            self._check_healthy()
            if time.monotonic() > deadline:
                raise RankFailedError(f"the ranks did not report their expert loads within {timeout}s")
        total = torch.stack(list(self._loads.values())).sum(dim=0)
        save_profile(path, total)
        return total

    def requests_per_rank(self) -> list[int]:
        """Unfinished requests on each rank."""
        return [sum(1 for r in self._owner.values() if r == rank) for rank in range(self.world_size)]

    # --- messages ------------------------------------------------------------------------------------

    def _pump(self, timeout: float) -> None:
        wait = timeout
        while True:
            try:
                message = self._outbox.get(timeout=wait) if wait else self._outbox.get_nowait()
            except queue.Empty:
                break
            wait = 0.0
            self._handle(message)
        for rank, p in enumerate(self._procs):
            if p.exitcode is not None and rank not in self._dead and not self._stopping:
                self._fail(rank, f"rank {rank} exited with code {p.exitcode}")

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind, rank = message[0], message[1]
        if kind == "out":
            for out in message[2]:
                self._deliver(rank, out)
        elif kind == "ack":
            self._acks[message[2]] = message[3]
            self.constraint_warnings[message[2]] = tuple(message[4])
        elif kind == "status":
            self.rank_status[rank] = message[2]
        elif kind == "load":
            self._loads[rank] = message[2]
        elif kind == "metrics":
            self.rank_metrics[rank] = message[2]
        elif kind == "cp":
            # Every rank joins a context-parallel prefill; one forwarding order for all of them.
            for r, inbox in enumerate(self._inboxes):
                if r not in self._dead:
                    inbox.put(("cp", message[2]))
        elif kind == "error":
            self._rank_error(rank, message[2])

    def _deliver(self, rank: int, out: RequestOutput) -> None:
        if out.request_id not in self._owner:
            return
        produced = len(out.outputs[0].token_ids) if out.outputs else 0
        self.generated_tokens[rank] += produced - self._seen_tokens.get(out.request_id, 0)
        self._seen_tokens[out.request_id] = produced
        model = self._models.get(out.request_id)
        if out.finished:
            self._owner.pop(out.request_id, None)
            self._models.pop(out.request_id, None)
            self._seen_tokens.pop(out.request_id, None)
            self.constraint_warnings.pop(out.request_id, None)
            if model is not None:
                out = _validated(out, model)
        self._buffer.append(out)

    def _rank_error(self, rank: int, text: str) -> None:
        """A rank reported a failure. A collective that broke because a peer died fails on the
        survivor first, so a peer that exited meanwhile is named as the cause."""
        lines = [line for line in text.splitlines() if line.strip()]
        summary = lines[-1] if lines else "unknown error"
        logger.error("rank %d failed:\n%s", rank, text)
        deadline = time.monotonic() + _PEER_EXIT_GRACE_S
        while time.monotonic() < deadline:
            for r, p in enumerate(self._procs):
                if r != rank and r not in self._dead and p.exitcode not in (None, 0):
                    self._fail(r, f"rank {r} exited with code {p.exitcode}")
                    return
            time.sleep(0.05)
        self._fail(rank, f"rank {rank} failed: {summary}")

    def _fail(self, rank: int, reason: str) -> None:
        if rank in self._dead:
            return
        logger.error("data-parallel engine unhealthy: %s", reason.splitlines()[0])
        self._healthy = False
        self._dead.add(rank)
        broken = set(range(self.world_size)) if self._coupled else {rank}
        first_line = reason.splitlines()[0]
        for request_id, owner in list(self._owner.items()):
            if owner in broken:
                self._owner.pop(request_id)
                self._models.pop(request_id, None)
                self.constraint_warnings.pop(request_id, None)
                self._buffer.append(_failed(request_id, f"RankFailedError: {first_line}"))
        if self._coupled:
            # The survivors wait in collectives that can no longer complete.
            self._dead.update(range(self.world_size))
            _terminate(self._procs, [])

    @property
    def healthy(self) -> bool:
        """False once a rank failed or exited (read-only: safe from another thread, e.g. /health)."""
        return self._healthy and (self._stopping or all(p.exitcode is None for p in self._procs))

    def _check_healthy(self) -> None:
        if self._healthy and not self.healthy:
            self._pump(0.0)  # names the dead rank and fails its requests
        if not self.healthy:
            raise RankFailedError(
                f"the data-parallel engine is unhealthy: rank(s) {sorted(self._dead)} failed",
                rank=min(self._dead) if self._dead else None,
            )

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop every rank (lock-step ranks stop together), killing those that do not exit in time."""
        self._stopping = True
        for inbox in self._inboxes:
            inbox.put(("stop",))
        deadline = time.monotonic() + timeout
        for p in self._procs:
            if p.pid is not None:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        self._finalizer()


def _terminate(procs: list[Any], inboxes: list[Any]) -> None:
    for inbox in inboxes:
        with contextlib.suppress(OSError, ValueError):  # a queue already closed
            inbox.put(("stop",))
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            p.kill()
            p.join(timeout=5)


def _to_wire(params: SamplingParams | None) -> tuple[SamplingParams | None, Any]:
    """``params`` safe to pickle to a rank: a Pydantic class is replaced by the JSON Schema the
    grammar front end derives from it (the class itself stays here to validate the output)."""
    if params is None or params.structured is None:
        return params, None
    s: StructuredOutput = params.structured
    model = s.model if s.model is not None else (s.value if isinstance(s.value, type) else None)
    if model is None:
        return params, None
    from agent_infer.grammar.frontends.json_schema import load_schema

    wire = StructuredOutput(s.kind, load_schema(model), s.options)
    return dataclasses.replace(params, structured=wire), model


def _validated(out: RequestOutput, model: Any) -> RequestOutput:
    """The output with ``parsed`` an instance of the request's Pydantic class, as a local engine gives."""
    completions = []
    for c in out.outputs:
        if c.parsed is None:
            completions.append(c)
            continue
        try:
            completions.append(dataclasses.replace(c, parsed=model.model_validate(c.parsed)))
        except Exception as exc:  # pydantic.ValidationError: validators beyond what the schema states
            completions.append(
                dataclasses.replace(c, parsed=None, parse_error=f"{type(exc).__name__}: {exc}")
            )
    return dataclasses.replace(out, outputs=completions)


def _failed(request_id: str, error: str) -> RequestOutput:
    now = time.perf_counter()
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=[],
        outputs=[CompletionOutput(text="", token_ids=[], finish_reason="error", logprobs=None, error=error)],
        num_cached_tokens=0,
        metrics=RequestMetrics(
            arrival_time=now,
            first_scheduled_time=None,
            first_token_time=None,
            finished_time=now,
            num_preemptions=0,
        ),
    )
