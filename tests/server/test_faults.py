"""Internal errors: a counted, logged 500 in OpenAI's shape, and the keep-alive connection survives."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import httpx
import pytest
from server_harness import LiveServer, server_fixture

import agent_infer.server.app as server_app
from agent_infer.server.chat import _ChatResponder

server = server_fixture()


def _body(server: LiveServer, **fields: Any) -> dict[str, Any]:
    return {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}


def _local_port(resp: httpx.Response) -> int:
    # The client side of the TCP connection that carried this response.
    port: int = resp.extensions["network_stream"].get_extra_info("client_addr")[1]
    return port


def _count(server: LiveServer, status: int) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    found = re.search(
        rf'^agent_infer_http_requests_total\{{endpoint="/v1/chat/completions",status="{status}"\}} (\S+)$',
        text,
        re.MULTILINE,
    )
    return float(found.group(1)) if found else 0.0


def test_unexpected_error_is_a_counted_500_and_the_connection_survives(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(*_: Any) -> Any:
        raise RuntimeError("simulated handler bug")

    monkeypatch.setattr(server_app, "create_chat_completion", broken)
    before = _count(server, 500)
    with caplog.at_level(logging.ERROR, logger="agent_infer.server"), httpx.Client(timeout=60) as client:
        failed = client.post(server.v1 + "/chat/completions", json=_body(server))
        assert failed.status_code == 500
        error = failed.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "internal_error"
        assert "RuntimeError: simulated handler bug" in error["message"]
        assert failed.headers.get("connection", "").lower() != "close"
        monkeypatch.undo()
        ok = client.post(server.v1 + "/chat/completions", json=_body(server))
        assert ok.status_code == 200, ok.text
        assert _local_port(ok) == _local_port(failed), "the 500 closed the keep-alive connection"
    assert _count(server, 500) == before + 1
    assert any(r.exc_info and "simulated handler bug" in str(r.exc_info[1]) for r in caplog.records)


def test_unexpected_error_mid_stream_ends_the_stream_and_the_connection_survives(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any) -> Any:
        raise RuntimeError("simulated delta bug")

    monkeypatch.setattr(_ChatResponder, "increment", broken)
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", server.v1 + "/chat/completions", json=_body(server, stream=True)) as resp:
            assert resp.status_code == 200
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
            first_port = _local_port(resp)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "internal_error" and "simulated delta bug" in error["message"]
        monkeypatch.undo()
        ok = client.post(server.v1 + "/chat/completions", json=_body(server))
        assert ok.status_code == 200, ok.text
        assert _local_port(ok) == first_port, "the failed stream closed the keep-alive connection"
