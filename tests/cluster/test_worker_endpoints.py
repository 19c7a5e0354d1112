"""The sglang-router worker surface: SGLang's extension fields and the worker endpoints."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from server_harness import LiveServer, server_fixture

server = server_fixture()

ASK = [{"role": "user", "content": "Count from one to ten in words, separated by commas."}]
#: What sglang-router 0.3.2 adds to every chat request it forwards (observed on a logging server).
ROUTER_CHAT_FIELDS = {
    "logprobs": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "continue_final_message": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
ROUTER_COMPLETION_FIELDS = {
    "echo": False,
    "no_stop_trim": False,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "return_hidden_states": False,
}


def _chat(server: LiveServer, **body: Any) -> httpx.Response:
    body = {"model": server.model, "messages": ASK, "temperature": 0, "max_tokens": 24, **body}
    return httpx.post(server.v1 + "/chat/completions", json=body, timeout=120)


def _text(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["message"]["content"])


def test_router_defaults_give_the_same_output_as_a_plain_request(server: LiveServer) -> None:
    plain = _text(_chat(server))
    assert _text(_chat(server, **ROUTER_CHAT_FIELDS)) == plain
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    bare = httpx.post(server.v1 + "/completions", json=body, timeout=120)
    routed = httpx.post(server.v1 + "/completions", json={**body, **ROUTER_COMPLETION_FIELDS}, timeout=120)
    assert bare.status_code == routed.status_code == 200, routed.text
    assert bare.json()["choices"][0]["text"] == routed.json()["choices"][0]["text"]


def _complete(server: LiveServer, **body: Any) -> str:
    body = {"model": server.model, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0, **body}
    resp = httpx.post(server.v1 + "/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


def test_no_stop_trim_keeps_the_stop_string(server: LiveServer) -> None:
    words = _complete(server).split()
    assert len(words) >= 4
    stop = " " + words[2]
    trimmed = _complete(server, stop=[stop])
    kept = _complete(server, stop=[stop], no_stop_trim=True)
    assert stop not in trimmed
    assert kept == trimmed + stop


def test_ignore_eos_runs_to_max_tokens(server: LiveServer) -> None:
    short = [{"role": "user", "content": "Reply with the single word yes."}]
    ended = _chat(server, messages=short, max_tokens=48).json()
    assert ended["choices"][0]["finish_reason"] == "stop"
    forced = _chat(server, messages=short, max_tokens=48, ignore_eos=True).json()
    assert forced["choices"][0]["finish_reason"] == "length"
    assert forced["usage"]["completion_tokens"] == 48


def test_skip_special_tokens_false_keeps_special_token_text(server: LiveServer) -> None:
    short = [{"role": "user", "content": "Reply with the single word yes."}]
    # With EOS ignored the model writes its end-of-turn token and goes on: its text shows only
    # when special tokens are kept.
    kept = _text(_chat(server, messages=short, max_tokens=48, ignore_eos=True, skip_special_tokens=False))
    skipped = _text(_chat(server, messages=short, max_tokens=48, ignore_eos=True))
    assert "<|im_end|>" in kept
    assert "<|im_end|>" not in skipped


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("return_hidden_states", True),
        ("continue_final_message", True),
    ],
)
def test_extensions_that_cannot_be_honoured_are_400s_naming_them(
    server: LiveServer, field: str, value: Any
) -> None:
    resp = _chat(server, **{field: value})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == field


def test_unknown_fields_are_still_400s(server: LiveServer) -> None:
    resp = _chat(server, no_stop_trimm=True)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "no_stop_trimm"


def test_bootstrap_fields_on_a_colocated_server_are_400s(server: LiveServer) -> None:
    pd = {"bootstrap_host": "127.0.0.1", "bootstrap_port": 8998}
    # The router draws rooms from the whole u64 range: above i64 still reaches the PD check.
    resp = _chat(server, **pd, bootstrap_room=2**64 - 1)
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "not_a_pd_worker"
    resp = _chat(server, **pd, bootstrap_room=2**64)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "bootstrap_room"
    resp = _chat(server, bootstrap_room=5)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "bootstrap_host"


def test_info_endpoints_name_the_served_model_and_no_paths(server: LiveServer) -> None:
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        body = httpx.get(server.base_url + path, timeout=30).json()
        assert body["served_model_name"] == server.model
        # A path would make the router try to download a tokenizer for it.
        assert "model_path" not in body and "tokenizer_path" not in body
    info = httpx.get(server.base_url + "/server_info", timeout=30).json()
    blocks = server.engine.block_manager
    assert info["max_total_num_tokens"] == blocks.num_blocks * blocks.block_size


def test_get_load_has_sglangs_per_rank_shape(server: LiveServer) -> None:
    load = httpx.get(server.base_url + "/get_load", timeout=30).json()
    assert isinstance(load, list) and len(load) == 1
    assert set(load[0]) == {"dp_rank", "num_reqs", "num_waiting_reqs", "num_tokens"}
    assert load[0]["num_reqs"] == 0 and load[0]["num_tokens"] == 0


def test_flush_cache_drops_cached_prefixes(server: LiveServer) -> None:
    long_system = "You are a careful assistant. " * 20
    messages = [{"role": "system", "content": long_system}, {"role": "user", "content": "Hi"}]
    _chat(server, messages=messages, max_tokens=2)
    again = _chat(server, messages=messages, max_tokens=2).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    flushed = httpx.post(server.base_url + "/flush_cache", timeout=30)
    assert flushed.status_code == 200, flushed.text
    assert flushed.json()["flushed_blocks"] > 0
    cold = _chat(server, messages=messages, max_tokens=2).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def _cached_total(server: LiveServer) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("agent_infer_prompt_tokens_cached_total "))
    return float(line.split()[1])


def test_metrics_count_cached_prompt_tokens(server: LiveServer) -> None:
    messages = [
        {"role": "system", "content": "Answer briefly and politely. " * 20},
        {"role": "user", "content": "Yo"},
    ]
    _chat(server, messages=messages, max_tokens=2)
    before = _cached_total(server)
    cached = _chat(server, messages=messages, max_tokens=2).json()["usage"]["prompt_tokens_details"][
        "cached_tokens"
    ]
    assert cached > 0
    assert _cached_total(server) == before + cached
