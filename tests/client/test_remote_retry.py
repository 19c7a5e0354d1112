"""Remote retries against a real agent-infer server on loopback, behind a proxy that fails on purpose."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from server_harness import LiveServer, server_fixture

from agent_infer import AsyncClient, Client
from agent_infer.errors import ConfigError, RemoteError

server = server_fixture()


class FlakyProxy:
    """Forwards POSTs to the server, first answering ``failures`` of them with the given statuses."""

    def __init__(self, upstream: str, failures: list[tuple[int, dict[str, str]]]) -> None:
        self.upstream = upstream
        self.failures = list(failures)
        self.seen: list[float] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                proxy.seen.append(time.monotonic())
                if proxy.failures:
                    status, headers = proxy.failures.pop(0)
                    self.send_response(status)
                    for k, v in headers.items():
                        self.send_header(k, v)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                r = httpx.post(
                    proxy.upstream + self.path,
                    content=body,
                    headers={"Content-Type": "application/json"},
                    timeout=120,
                )
                self.send_response(r.status_code)
                self.send_header("Content-Type", r.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FlakyProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def upstream(server: LiveServer) -> Iterator[str]:
    yield server.base_url


def test_rate_limits_and_server_errors_are_retried(upstream: str, server: LiveServer) -> None:
    failures = [(429, {"Retry-After": "0"}), (503, {})]
    with FlakyProxy(upstream, failures) as proxy:
        client = Client(base_url=proxy.url, model=server.model, http_backoff=0.05)
        assert client.generate("Yes or no?", choice=["yes", "no"]) in ("yes", "no")
        assert len(proxy.seen) == 3
        assert proxy.seen[2] - proxy.seen[1] >= 0.1  # the second wait doubled the first


def test_streams_and_async_calls_are_retried(upstream: str, server: LiveServer) -> None:
    with FlakyProxy(upstream, [(502, {}), (500, {})]) as proxy:
        client = Client(base_url=proxy.url, model=server.model, http_backoff=0.01)
        items = list(client.generate_stream("Yes or no?", choice=["yes", "no"]))
        assert items[-1] in ("yes", "no") and len(proxy.seen) == 3

    with FlakyProxy(upstream, [(504, {})]) as proxy:

        async def main() -> Any:
            async with AsyncClient(base_url=proxy.url, model=server.model, http_backoff=0.01) as aclient:
                return await aclient.generate("Yes or no?", choice=["yes", "no"])

        assert asyncio.run(main()) in ("yes", "no") and len(proxy.seen) == 2


def test_retries_are_bounded_and_the_last_failure_is_raised(upstream: str, server: LiveServer) -> None:
    with FlakyProxy(upstream, [(503, {})] * 5) as proxy:
        client = Client(base_url=proxy.url, model=server.model, http_retries=1, http_backoff=0.01)
        with pytest.raises(RemoteError) as info:
            client.generate("Yes or no?", choice=["yes", "no"])
        assert info.value.status == 503 and len(proxy.seen) == 2

    with FlakyProxy(upstream, [(400, {})]) as proxy:  # a mistake in the request: not retried
        client = Client(base_url=proxy.url, model=server.model, http_backoff=0.01)
        with pytest.raises(RemoteError):
            client.generate("Yes or no?", choice=["yes", "no"])
        assert len(proxy.seen) == 1


def test_connection_failures_are_retried_then_reported() -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = Client(base_url=f"http://127.0.0.1:{port}/v1", model="m", http_retries=2, http_backoff=0.01)
    with pytest.raises(RemoteError) as info:
        client.generate("hi")
    assert info.value.status == 0 and "3 attempt(s)" in str(info.value)


def test_retry_options_are_checked() -> None:
    with pytest.raises(ConfigError, match="http_retries"):
        Client(base_url="http://127.0.0.1:1/v1", http_retries=-1)
    with pytest.raises(ConfigError, match="http_backoff"):
        Client(base_url="http://127.0.0.1:1/v1", http_backoff=float("nan"))
    with pytest.raises(ConfigError, match="remote"):
        Client(http_retries=3)
