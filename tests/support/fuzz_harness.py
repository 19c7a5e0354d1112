"""The guarded side of the grammar fuzz suite: a worker process per session that runs cases.

The worker (:mod:`fuzz_worker`, its oracles in :mod:`fuzz_oracles`) runs under an address-space
limit and answers each case within a timeout, so a segfault, an abort (a sanitizer report
included), a hang or a memory blow-up costs one worker restart and is reported with its
reproducer, not a dead pytest. Shared by ``tests/grammar/test_fuzz.py`` and
``benchmarks/fuzz_campaign.py``.

Knobs (test-side only): ``AGENT_INFER_FUZZ_EXAMPLES`` (examples per fuzz test, read by the test),
``AGENT_INFER_FUZZ_TIMEOUT`` (seconds per case, default 30), ``AGENT_INFER_FUZZ_MEMORY_MB``
(worker address-space limit, default 6144; 0 = none, which sanitizer runs need).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

TESTS_DIR = Path(__file__).resolve().parent
FAILURE_KINDS = ("crash", "hang", "slow", "blowup", "wrong", "untyped")


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw else default


def case_timeout() -> float:
    """Seconds one case may take: a case past it is a hang (the compile limit is 5 s)."""
    return float(_env_int("AGENT_INFER_FUZZ_TIMEOUT", 30))


def memory_limit_mb() -> int:
    """The worker's address-space limit. ASan reserves terabytes of shadow: no limit under it."""
    if "libasan" in os.environ.get("LD_PRELOAD", ""):
        return 0
    return _env_int("AGENT_INFER_FUZZ_MEMORY_MB", 6144)


class GuardedWorker:
    """A long-lived ``fuzz_worker.py --serve`` process, restarted after each crash or hang."""

    def __init__(self, tokenizers: tuple[str, ...] = ("bytes",)) -> None:
        self.tokenizers = list(tokenizers)
        self.proc: subprocess.Popen[bytes] | None = None
        self.stderr_path = Path(tempfile.mkstemp(prefix="agent_infer_fuzz_", suffix=".log")[1])
        self._buffer = b""

    def _start(self) -> None:
        env = dict(os.environ, AGENT_INFER_FUZZ_MEMORY_MB=str(memory_limit_mb()))
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(TESTS_DIR / "fuzz_worker.py"), "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=TESTS_DIR.parent.parent,
                env=env,
            )
        self._buffer = b""
        # Imports and tokenizers load outside the per-case clock (SmolLM2's takes seconds).
        answer = self._ask({"op": "warm", "tokenizers": self.tokenizers}, timeout=600)
        if answer.get("status") != "ok":
            raise RuntimeError(f"fuzz worker failed to start: {answer}")

    def _ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            return self._died()
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                self.close()
                return {"status": "hang", "detail": f"no answer within {timeout:.0f} s"}
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return self._died()
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return dict(json.loads(line))

    def _died(self) -> dict[str, Any]:
        assert self.proc is not None
        code = self.proc.wait()
        self.proc = None
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        tail = self.stderr_path.read_bytes()[-6000:].decode("utf-8", "replace")
        return {"status": "crash", "detail": f"worker died ({how}); its stderr ends:\n{tail}"}

    def run(self, case: dict[str, Any]) -> dict[str, Any]:
        """The verdict on ``case``: the worker's, or ``crash``/``hang`` when it dies or stalls."""
        if self.proc is None:
            self._start()
        return self._ask({"op": "case", "case": case}, timeout=case_timeout())

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def __del__(self) -> None:
        self.close()


def reproducer(case: dict[str, Any], result: dict[str, Any]) -> str:
    """A failure report: the verdict, the case as JSON and how to re-run it."""
    text = json.dumps(case, ensure_ascii=True)
    return (
        f"{result['status']}: {result.get('detail', '')}\n"
        f"case: {text}\n"
        "re-run: save the case line to case.json, then `python tests/support/fuzz_worker.py case.json`"
    )


def save_reproducer(folder: Path, case: dict[str, Any], result: dict[str, Any], n: int) -> Path:
    """Write ``case`` with its verdict as ``folder/<status>-<n>.json`` (the worker's input format)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{result['status']}-{n:04d}.json"
    path.write_text(json.dumps({"case": case, "result": result}, indent=1, ensure_ascii=True))
    return path


def assert_case(worker: GuardedWorker, case: dict[str, Any]) -> str:
    """Fail (with the reproducer) unless ``case`` ends ``ok`` or in a typed error; its status."""
    result = worker.run(case)
    if result["status"] not in ("ok", "typed"):
        raise AssertionError(reproducer(case, result))
    return str(result["status"])
