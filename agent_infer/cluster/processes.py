"""Replica and router processes on one host: start, wait until healthy, scrape, stop.

A replica is ``agent-infer serve`` in a process of its own; the router is sglang-router's
``launch_router`` (the ``cluster`` extra). Used by the cluster tests and ``bench_cluster.py``, and
a worked example of the recipe in docs/serving.md.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from agent_infer.errors import ConfigError, EngineError

#: Routing policies of sglang-router 0.3.x.
POLICIES = ("random", "round_robin", "cache_aware", "power_of_two")


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Process:
    """One child process, its URL and where its output goes."""

    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        """True while the process runs."""
        return self.popen.poll() is None

    def kill(self) -> None:
        """SIGKILL: the process dies mid-request, as a crashed replica does."""
        if self.alive():
            self.popen.kill()
            self.popen.wait(30)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGINT (graceful), then SIGKILL after ``timeout`` seconds."""
        if not self.alive():
            return
        self.popen.send_signal(signal.SIGINT)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def tail(self, chars: int = 4000) -> str:
        """The end of the process's output (for error messages)."""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class LocalCluster:
    """Replicas and routers started here; ``close()`` stops them all (also as a context manager)."""

    log_dir: Path
    processes: list[Process] = field(default_factory=list)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process, routers first."""
        for proc in reversed(self.processes):
            proc.stop()

    def _spawn(self, name: str, url: str, cmd: Sequence[str], env: dict[str, str] | None = None) -> Process:
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(
                list(cmd),
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "OMP_WAIT_POLICY": "PASSIVE", **(env or {})},
            )
        proc = Process(name, url, popen, log)
        self.processes.append(proc)
        return proc

    def replica(
        self,
        *,
        model: str | None = None,
        port: int | None = None,
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
    ) -> Process:
        """Start ``agent-infer serve`` on loopback (``args``: more ``serve`` flags)."""
        port = port or free_port()
        cmd = [sys.executable, "-m", "agent_infer.cli", "serve", "--port", str(port), *args]
        if model is not None:
            cmd += ["--model", model]
        return self._spawn(f"replica-{port}", f"http://127.0.0.1:{port}", cmd, env)

    def router(
        self,
        workers: Sequence[str],
        *,
        policy: str = "cache_aware",
        port: int | None = None,
        args: Sequence[str] = (),
    ) -> Process:
        """Start sglang-router in front of ``workers`` (URLs), health-checking them every second."""
        if policy not in POLICIES:
            raise ConfigError(f"unknown router policy {policy!r}; known: {', '.join(POLICIES)}")
        port = port or free_port()
        cmd = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            *workers,
            "--policy",
            policy,
            "--health-check-interval-secs",
            "1",
            "--health-failure-threshold",
            "1",
            "--log-level",
            "warn",
            *args,
        ]
        return self._spawn(f"router-{port}", f"http://127.0.0.1:{port}", cmd)

    def pd_router(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        *,
        port: int | None = None,
        args: Sequence[str] = (),
    ) -> Process:
        """Start sglang-router in PD mode; each prefill worker's bootstrap port is its HTTP port."""
        port = port or free_port()
        cmd = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ]
        cmd += ["--pd-disaggregation", "--policy", "round_robin"]
        for url in prefill:
            cmd += ["--prefill", url, url.rsplit(":", 1)[1]]
        for url in decode:
            cmd += ["--decode", url]
        cmd += ["--health-check-interval-secs", "1", "--log-level", "warn", *args]
        return self._spawn(f"pd-router-{port}", f"http://127.0.0.1:{port}", cmd)


def wait_healthy(proc: Process, timeout: float = 180.0, path: str = "/health") -> None:
    """Wait until ``proc`` answers 200 on ``path``; EngineError naming it if it dies or times out."""
    deadline = time.monotonic() + timeout
    while True:
        if not proc.alive():
            raise EngineError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        try:
            if httpx.get(proc.url + path, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise EngineError(f"{proc.name} was not healthy after {timeout:.0f} s:\n{proc.tail()}")
        time.sleep(0.25)


def wait_router_ready(router: Process, workers: int, timeout: float = 60.0) -> None:
    """Wait until the router lists ``workers`` healthy workers."""
    deadline = time.monotonic() + timeout
    while True:
        if not router.alive():
            raise EngineError(f"{router.name} exited with {router.popen.returncode}:\n{router.tail()}")
        try:
            listed = httpx.get(router.url + "/workers", timeout=2).json().get("workers", [])
            if sum(1 for w in listed if w.get("is_healthy")) >= workers:
                return
        except (httpx.TransportError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise EngineError(f"{router.name} did not list {workers} healthy workers:\n{router.tail()}")
        time.sleep(0.25)


def scrape(url: str) -> dict[str, float]:
    """A replica's ``/metrics`` as ``{name{labels}: value}`` (comments dropped)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
