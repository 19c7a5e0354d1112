"""logit_bias, min_tokens, cached-token usage, /tokenize and /detokenize, GET /v1/models/{id}."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from server_harness import LiveServer, openai_client, server_fixture

openai = pytest.importorskip("openai")

server = server_fixture()

ASK = [{"role": "user", "content": "Reply with the single word yes."}]


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    return openai_client(server)


def _tokenize(server: LiveServer, **body: Any) -> dict[str, Any]:
    resp = httpx.post(server.base_url + "/tokenize", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _chat(client: Any, server: LiveServer, **kw: Any) -> Any:
    kw.setdefault("messages", ASK)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=server.model, **kw)


def test_logit_bias_bans_and_forces_tokens(client: Any, server: LiveServer) -> None:
    plain = _chat(client, server, max_tokens=3, logprobs=True)
    first = plain.choices[0].logprobs.content[0].token
    first_id = _tokenize(server, prompt=first, add_special_tokens=False)["tokens"][0]
    banned = _chat(client, server, max_tokens=3, logprobs=True, logit_bias={str(first_id): -100})
    assert banned.choices[0].logprobs.content[0].token != first
    forced_id = _tokenize(server, prompt="banana", add_special_tokens=False)["tokens"][0]
    forced = _chat(client, server, max_tokens=3, logit_bias={str(forced_id): 100})
    # +100 outweighs any logit difference: every sampled token is the biased one.
    assert (
        _tokenize(server, prompt=forced.choices[0].message.content, add_special_tokens=False)["tokens"]
        == [forced_id] * 3
    )


def test_min_tokens_holds_back_the_end(client: Any, server: LiveServer) -> None:
    plain = _chat(client, server, max_tokens=80)
    n = plain.usage.completion_tokens
    assert plain.choices[0].finish_reason == "stop" and n < 70
    longer = _chat(client, server, max_tokens=80, extra_body={"min_tokens": n + 6})
    assert longer.usage.completion_tokens >= n + 6
    # A stop string before min_tokens does not end the request either.
    stop = [plain.choices[0].message.content[:3]]
    early = _chat(client, server, max_tokens=80, stop=stop)
    assert early.usage.completion_tokens < 6
    held = _chat(client, server, max_tokens=80, stop=stop, extra_body={"min_tokens": 6})
    assert held.usage.completion_tokens >= 6


def test_min_tokens_yields_to_a_grammar_that_must_end(client: Any, server: LiveServer) -> None:
    resp = _chat(
        client,
        server,
        max_tokens=20,
        extra_body={"min_tokens": 10, "structured_outputs": {"choice": ["yes"]}},
    )
    assert resp.choices[0].message.content == "yes" and resp.choices[0].finish_reason == "stop"


def test_cached_tokens_reported_from_the_prefix_cache(client: Any, server: LiveServer) -> None:
    messages = [{"role": "user", "content": "Cache probe. " + "alpha beta gamma delta " * 40}]
    first = _chat(client, server, messages=messages, max_tokens=1)
    second = _chat(client, server, messages=messages, max_tokens=1)
    cached_first = first.usage.prompt_tokens_details.cached_tokens
    cached_second = second.usage.prompt_tokens_details.cached_tokens
    assert cached_first < 100 <= cached_second < second.usage.prompt_tokens


def test_tokenize_and_detokenize(client: Any, server: LiveServer) -> None:
    text = _tokenize(server, prompt="Hello world", return_token_strs=True)
    assert text["count"] == len(text["tokens"]) > 0 and text["max_model_len"] > 0
    assert len(text["token_strs"]) == text["count"]
    resp = httpx.post(server.base_url + "/detokenize", json={"tokens": text["tokens"]}, timeout=60)
    assert resp.status_code == 200 and resp.json()["prompt"].endswith("Hello world")
    # The chat form counts exactly the tokens a chat request's prompt has.
    chat = _tokenize(server, model=server.model, messages=ASK)
    assert chat["count"] == _chat(client, server, max_tokens=1).usage.prompt_tokens


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
        ("/detokenize", {"tokens": [10**9]}, "tokens.0"),
        ("/detokenize", {"tokens": [-1]}, "tokens.0"),
    ],
)
def test_tokenize_errors_name_the_field(server: LiveServer, path: str, body: Any, param: str) -> None:
    resp = httpx.post(server.base_url + path, json=body, timeout=60)
    assert resp.status_code in (400, 404), resp.text
    assert resp.json()["error"]["param"] == param


def test_retrieve_model(client: Any, server: LiveServer) -> None:
    card = client.models.retrieve(server.model)
    assert card.id == server.model and card.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
