"""One background thread drives ``LLMEngine.step()``; asyncio handlers talk to it through queues.

The engine is not thread-safe, so every call on it (add, abort, step) happens on the engine
thread. Handlers submit commands and await a future (``add`` raises the engine's synchronous
``InvalidRequestError`` in the caller); outputs are handed to each request's :class:`RequestStream`
on the event loop with one ``call_soon_threadsafe`` per step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from agent_infer.engine.grammar_manager import GrammarTimings
from agent_infer.engine.llm_engine import LLMEngine, Prompt
from agent_infer.engine.output import RequestOutput
from agent_infer.errors import EngineError
from agent_infer.sampling_params import SamplingParams
from agent_infer.server.metrics import ServerMetrics
from agent_infer.thread_exit import stop_at_exit

logger = logging.getLogger(__name__)

# How long the idle engine thread sleeps between checks for shutdown (commands wake it at once).
_IDLE_WAIT_S = 0.5


class EngineStoppedError(EngineError):
    """The engine thread is not running (server shutting down, or it crashed)."""


class RequestStream:
    """The latest output of one request, for one consumer on the event loop.

    Outputs are cumulative snapshots, so a consumer slower than the engine only needs the newest
    one: keeping just that bounds memory whatever the speed difference.
    """

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        #: The request field that carried the output constraint (named in errors), if any.
        self.constraint_field: str | None = None
        #: What the constraint's lowering ignored (``Grammar.warnings``), set when the engine takes it.
        self.warnings: tuple[str, ...] = ()
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False

    def put(self, output: RequestOutput) -> None:
        """Called on the event loop with the request's newest snapshot."""
        self._latest = output
        self._event.set()

    def fail(self, error: BaseException) -> None:
        """Called on the event loop when the engine cannot continue this request."""
        self._error = error
        self._event.set()

    async def next(self) -> RequestOutput:
        """The next unseen snapshot (waits for one); raises the failure, if any."""
        await self._event.wait()
        self._event.clear()
        if self._error is not None:
            raise self._error
        output = self._latest
        if output is None:  # only set together with the event above
            raise EngineStoppedError("request stream woke without an output")
        self.finished = output.finished
        return output

    async def final(self) -> RequestOutput:
        """Wait for the finished output."""
        while True:
            output = await self.next()
            if output.finished:
                return output


@dataclass
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    stream: RequestStream
    future: concurrent.futures.Future[None]
    #: A prefilled request (PD decode side): its first token and the KV loader.
    prefilled: tuple[int, Callable[[list[int], int], int]] | None = None


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread (between steps) and hand back its result."""

    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future[Any]


@dataclass
class EngineSnapshot:
    """Scheduler and KV-pool numbers, written by the engine thread after each iteration."""

    waiting: int = 0
    waiting_for_grammar: int = 0
    running: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    prompt_tokens_computed: int = 0
    grammar: GrammarTimings = field(default_factory=GrammarTimings)


class AsyncEngine:
    """Runs an :class:`LLMEngine` on its own thread and serves many asyncio requests at once."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.snapshot = EngineSnapshot(
            kv_blocks_total=engine.block_manager.num_blocks,
            kv_blocks_free=engine.block_manager.num_free_blocks,
        )
        self._commands: queue.SimpleQueue[_Add | _Call | str] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._streams: dict[str, RequestStream] = {}  # touched only by the engine thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; outputs are delivered on the calling thread's event loop."""
        if self._thread is not None:
            raise EngineError("the async engine is already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="agent-infer-engine", daemon=True)
        self._thread.start()
        stop_at_exit(self)

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything in flight and join the engine thread."""
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def stop_for_exit(self) -> None:
        """At interpreter exit: :meth:`stop` (see :mod:`agent_infer.thread_exit`)."""
        self.stop()

    @property
    def alive(self) -> bool:
        """True while the engine thread runs."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping.is_set()

    # --- requests (event loop side) ------------------------------------------------------------

    async def add(self, request_id: str, prompt: Prompt, params: SamplingParams) -> RequestStream:
        """Queue a request; raises what ``LLMEngine.add_request`` raises (e.g. InvalidRequestError)."""
        if not self.alive:
            raise EngineStoppedError("the engine is not running")
        stream = RequestStream(request_id)
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(_Add(request_id, prompt, params, stream, future))
        self._wake.set()
        await asyncio.wrap_future(future)
        return stream

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between two steps; returns what it returns."""
        if not self.alive:
            raise EngineStoppedError("the engine is not running")
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put(_Call(fn, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    async def add_prefilled(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        first_token: int,
        load_kv: Callable[[list[int], int], int],
    ) -> RequestStream:
        """Queue a request another replica prefilled (``LLMEngine.add_prefilled_request``)."""
        if not self.alive:
            raise EngineStoppedError("the engine is not running")
        stream = RequestStream(request_id)
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(_Add(request_id, token_ids, params, stream, future, (first_token, load_kv)))
        self._wake.set()
        await asyncio.wrap_future(future)
        return stream

    def abort(self, request_id: str) -> None:
        """Ask the engine to stop a request and free its KV blocks (no-op once it finished)."""
        self._commands.put(request_id)
        self._wake.set()

    # --- engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            self._wake.clear()
            self._apply_commands()
            if not engine.has_unfinished_requests():
                self._update_snapshot()
                self._wake.wait(_IDLE_WAIT_S)
                continue
            start = time.perf_counter()
            try:
                outputs = engine.step()
            except Exception as exc:  # an engine bug: fail what is in flight, keep serving
                logger.exception("engine step failed")
                self._fail_all(EngineError(f"engine step failed: {type(exc).__name__}: {exc}"))
                continue
            self.metrics.observe_step(time.perf_counter() - start)
            self._deliver(outputs)
            self._update_snapshot()
        self._shutdown()

    def _queued_commands(self) -> Iterator[_Add | _Call | str]:
        """The commands queued so far, without waiting for more."""
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply_commands(self) -> None:
        for command in self._queued_commands():
            if isinstance(command, str):
                if command in self._streams:
                    self.engine.abort(command)
                continue
            if isinstance(command, _Call):
                try:
                    command.future.set_result(command.fn(self.engine))
                except Exception as exc:
                    command.future.set_exception(exc)
                continue
            start = time.perf_counter()
            try:
                if command.prefilled is None:
                    self.engine.add_request(command.request_id, command.prompt, command.params)
                else:
                    ids = [int(t) for t in command.prompt if isinstance(t, int)]
                    first, load = command.prefilled
                    self.engine.add_prefilled_request(command.request_id, ids, command.params, first, load)
            except BaseException as exc:
                command.future.set_exception(exc)
                continue
            added = self.engine.requests.get(command.request_id)  # a prefilled one may end at once
            command.stream.warnings = added.constraint_warnings if added is not None else ()
            if command.params.structured is not None:
                self.metrics.observe_compile(time.perf_counter() - start)
            self._streams[command.request_id] = command.stream
            command.future.set_result(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batch: list[tuple[RequestStream, RequestOutput]] = []
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
                self.metrics.observe_finished(output)
            batch.append((stream, output))
        if batch and self._loop is not None:
            self._loop.call_soon_threadsafe(_put_all, batch)

    def _fail_all(self, error: BaseException) -> None:
        streams = list(self._streams.items())
        self._streams.clear()
        for request_id, _ in streams:
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("abort of %s failed", request_id)
        # Deliver the aborts' outputs so the engine forgets the requests and frees their blocks.
        try:
            while self.engine.has_unfinished_requests() and not self.engine.scheduler.has_unfinished():
                self.engine.step()
        except Exception:
            logger.exception("draining aborted requests failed")
        if self._loop is not None and streams:
            # RuntimeError: the event loop is closed (interpreter exit) and nobody reads the streams.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(_fail_all, [s for _, s in streams], error)

    def _update_snapshot(self) -> None:
        scheduler = self.engine.scheduler
        blocks = self.engine.block_manager
        self.snapshot = EngineSnapshot(
            waiting=len(scheduler.waiting),
            waiting_for_grammar=len(scheduler.waiting_for_grammar),
            running=len(scheduler.running),
            kv_blocks_total=blocks.num_blocks,
            kv_blocks_free=blocks.num_free_blocks,
            prompt_tokens_computed=scheduler.num_prompt_tokens_computed,
            grammar=self.engine.grammar.timings(),
        )

    def _shutdown(self) -> None:
        # Reject adds that raced the shutdown, then end what is in flight.
        for command in self._queued_commands():
            if not isinstance(command, str):
                command.future.set_exception(EngineStoppedError("the server is shutting down"))
        self._fail_all(EngineStoppedError("the server is shutting down"))
        self._update_snapshot()


def _put_all(batch: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, output in batch:
        stream.put(output)


def _fail_all(streams: list[RequestStream], error: BaseException) -> None:
    for stream in streams:
        stream.fail(error)


__all__ = ["AsyncEngine", "EngineSnapshot", "EngineStoppedError", "RequestStream"]
