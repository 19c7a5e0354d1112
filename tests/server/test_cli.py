"""``agent-infer serve`` as a real process: binds loopback by default, reads AGENT_INFER_API_KEY, shuts down on SIGINT."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_serve_subcommand_end_to_end() -> None:
    port = _free_port()
    env = {**os.environ, "AGENT_INFER_API_KEY": "k-123", "OMP_WAIT_POLICY": "PASSIVE"}
    cmd = [
        sys.executable,
        "-m",
        "agent_infer.cli",
        "serve",
        "--port",
        str(port),
        "--kv-cache-memory-bytes",
        str(32 * 1024 * 1024),
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.25)
        assert httpx.get(base + "/v1/models", timeout=10).status_code == 401
        models = httpx.get(base + "/v1/models", headers={"Authorization": "Bearer k-123"}, timeout=10).json()
        assert models["data"][0]["id"] == "SmolLM2-135M-Instruct.Q4_1"
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert f"http://127.0.0.1:{port}" in out  # the default bind address is loopback
