"""The OpenAI-compatible server on loopback, driven by the official ``openai`` client: happy paths."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import httpx
import pytest
from pydantic import BaseModel
from server_harness import LiveServer, openai_client, server_fixture

openai = pytest.importorskip("openai")


server = server_fixture()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    return openai_client(server)


def _chat(client: Any, server: LiveServer, content: str, **kw: Any) -> Any:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": content}], **kw
    )


def test_models_health_and_metrics(client: Any, server: LiveServer) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [server.model]
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    text = httpx.get(server.base_url + "/metrics").text
    assert "# TYPE agent_infer_kv_blocks_free gauge" in text
    assert re.search(r'agent_infer_http_requests_total\{endpoint="/v1/models",status="200"\} [1-9]', text)


def _metric(text: str, name: str) -> float:
    found = re.search(rf"^agent_infer_{name} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} missing from /metrics"
    return float(found.group(1))


def test_metrics_count_grammar_compiles_and_mask_fills(client: Any, server: LiveServer) -> None:
    before = httpx.get(server.base_url + "/metrics").text
    _chat(client, server, "Pick one.", extra_body={"structured_outputs": {"choice": ["red", "blue"]}})
    after = httpx.get(server.base_url + "/metrics").text
    for name in ("grammar_compile_seconds_count", "grammar_mask_seconds_count"):
        assert _metric(after, name) > _metric(before, name)
    assert _metric(after, "grammar_mask_seconds_sum") > 0
    assert _metric(after, "requests_waiting_for_grammar") == 0


def test_metrics_count_forced_and_draft_tokens(client: Any, server: LiveServer) -> None:
    before = httpx.get(server.base_url + "/metrics").text
    # Drafts are on by default: a reply that copies its prompt accepts some of them.
    _chat(client, server, "Repeat exactly: one two three four five one two three four five", max_tokens=20)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    _chat(
        client,
        server,
        "Answer in JSON.",
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    after = httpx.get(server.base_url + "/metrics").text
    assert _metric(after, "draft_tokens_total") > _metric(before, "draft_tokens_total")
    assert _metric(after, "accepted_draft_tokens_total") > _metric(before, "accepted_draft_tokens_total")
    assert _metric(after, "accepted_draft_tokens_total") <= _metric(after, "draft_tokens_total")
    assert _metric(after, "forced_tokens_total") > _metric(before, "forced_tokens_total")
    # The same per source: prompt lookup on this model (no MTP layers), forced text for the JSON.
    ngram = re.findall(r'^agent_infer_(\w+)\{source="ngram"\} (\S+)$', after, re.MULTILINE)
    by_name = {name: float(value) for name, value in ngram}
    assert by_name["source_draft_tokens_total"] >= by_name["source_accepted_draft_tokens_total"] > 0
    assert by_name["draft_verifications_total"] > 0


def test_chat_completion(client: Any, server: LiveServer) -> None:
    resp = _chat(client, server, "Say hello.")
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens >= 1
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_greedy_is_deterministic_and_max_completion_tokens_bounds(
    client: Any, server: LiveServer
) -> None:
    a = _chat(client, server, "Name three colors.", max_tokens=None, max_completion_tokens=7)
    b = _chat(client, server, "Name three colors.", max_tokens=None, max_completion_tokens=7)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.completion_tokens <= 7


def test_text_completion(client: Any, server: LiveServer) -> None:
    resp = client.completions.create(
        model=server.model, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert resp.choices[0].text
    assert resp.usage.prompt_tokens > 1
    assert resp.usage.completion_tokens <= 6


def test_text_completion_with_token_ids_and_regex(client: Any, server: LiveServer) -> None:
    resp = client.completions.create(
        model=server.model,
        prompt="Phone number: ",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
    )
    assert re.fullmatch(r"\d{3}-\d{4}", resp.choices[0].text)
    assert resp.choices[0].finish_reason == "stop"


def test_streaming_chat_equals_non_streaming(client: Any, server: LiveServer) -> None:
    whole = _chat(client, server, "Count from one to five.", max_tokens=20, stop=["four"])
    chunks = list(
        _chat(
            client,
            server,
            "Count from one to five.",
            max_tokens=20,
            stop=["four"],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_streaming_completion_ends_with_done(server: LiveServer) -> None:
    body = {
        "model": server.model,
        "prompt": "Once upon a time",
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", server.v1 + "/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(p["choices"][0]["text"] for p in payloads)


class Pet(BaseModel):
    name: str
    species: Literal["cat", "dog", "bird"]
    age: int


def test_parse_with_pydantic_model(client: Any, server: LiveServer) -> None:
    resp = client.chat.completions.parse(
        model=server.model,
        messages=[{"role": "user", "content": "Describe a pet as JSON."}],
        response_format=Pet,
        max_tokens=80,
        temperature=0,
    )
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(resp.choices[0].message.parsed, Pet)


def test_json_object_mode(client: Any, server: LiveServer) -> None:
    resp = _chat(
        client,
        server,
        'Output the JSON object {"x": 1}.',
        response_format={"type": "json_object"},
        max_tokens=60,
    )
    assert resp.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(resp.choices[0].message.content), dict)


def test_streamed_json_schema_parses(client: Any, server: LiveServer) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    stream = _chat(
        client,
        server,
        "Is water wet? JSON.",
        stream=True,
        max_tokens=30,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "a", "schema": schema, "strict": True},
        },
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text)["ok"], bool)


@pytest.mark.parametrize(
    ("spec", "check"),
    [
        ({"choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        (
            {"json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
            lambda t: all(isinstance(x, int) for x in json.loads(t)),
        ),
        ({"grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
        ({"grammar": 'start: "up" | "down"'}, lambda t: t in ("up", "down")),
    ],
)
def test_structured_outputs_field(client: Any, server: LiveServer, spec: dict[str, Any], check: Any) -> None:
    resp = _chat(client, server, "Answer.", max_tokens=30, extra_body={"structured_outputs": spec})
    assert resp.choices[0].finish_reason == "stop"
    assert check(resp.choices[0].message.content)


def test_chat_logprobs(client: Any, server: LiveServer) -> None:
    resp = _chat(client, server, "Hi", max_tokens=4, logprobs=True, top_logprobs=2)
    entries = resp.choices[0].logprobs.content
    assert len(entries) == resp.usage.completion_tokens
    assert "".join(e.token for e in entries).startswith(resp.choices[0].message.content)
    for entry in entries:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        # Greedy: the chosen token is the most likely one.
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_seeded_sampling_repeats_and_top_k_reaches_the_engine(client: Any, server: LiveServer) -> None:
    extra = {"top_k": 50, "min_p": 0.05}
    a = _chat(
        client, server, "Tell me a word.", temperature=1.0, top_p=0.9, seed=7, max_tokens=10, extra_body=extra
    )
    b = _chat(
        client, server, "Tell me a word.", temperature=1.0, top_p=0.9, seed=7, max_tokens=10, extra_body=extra
    )
    assert a.choices[0].message.content == b.choices[0].message.content
    # top_k=1 leaves only the arg-max, so hot sampling must reproduce greedy decoding.
    greedy = _chat(client, server, "Tell me a word.", max_tokens=10)
    top1 = _chat(
        client, server, "Tell me a word.", temperature=1.5, seed=3, max_tokens=10, extra_body={"top_k": 1}
    )
    assert top1.choices[0].message.content == greedy.choices[0].message.content


def test_text_completion_logprobs(client: Any, server: LiveServer) -> None:
    resp = client.completions.create(
        model=server.model, prompt="One, two,", max_tokens=3, temperature=0, logprobs=2
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens
    assert "".join(lp.tokens).startswith(resp.choices[0].text)
    assert lp.text_offset[0] == 0 and all(len(top) <= 2 for top in lp.top_logprobs)
    assert max(lp.top_logprobs[0].values()) == pytest.approx(lp.token_logprobs[0])


# OpenAI fields that change nothing in this server's output, with values SDKs send.
IGNORED = {
    "store": True,
    "metadata": {"run": "test"},
    "service_tier": "auto",
    "reasoning_effort": "low",
    "verbosity": "low",
    "prompt_cache_key": "conversation-1",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "prompt_cache_retention": "24h",
    "safety_identifier": "user-hash",
    "user": "user-1",
    "prediction": {"type": "content", "content": "Hello"},
}


def test_openai_fields_without_effect_are_accepted_and_ignored(client: Any, server: LiveServer) -> None:
    from agent_infer.server.protocol import IGNORED_FIELDS

    assert set(IGNORED) == set(IGNORED_FIELDS)
    plain = _chat(client, server, "Say hi.", max_tokens=4)
    # The SDK's own keyword arguments: what its users send.
    sent = _chat(client, server, "Say hi.", max_tokens=4, modalities=["text"], **IGNORED)
    assert sent.choices[0].message.content == plain.choices[0].message.content


def test_echoed_reasoning_content_is_accepted_and_left_out_of_the_prompt(
    client: Any, server: LiveServer
) -> None:
    def turn(assistant: dict[str, Any]) -> Any:
        messages = [
            {"role": "user", "content": "Hi"},
            assistant,
            {"role": "user", "content": "Say it again."},
        ]
        return client.chat.completions.create(
            model=server.model, messages=messages, max_tokens=4, temperature=0
        )

    plain = turn({"role": "assistant", "content": "Hello!"})
    echoed = turn({"role": "assistant", "content": "Hello!", "reasoning_content": "The user greets me."})
    assert echoed.usage.prompt_tokens == plain.usage.prompt_tokens
    assert echoed.choices[0].message.content == plain.choices[0].message.content


def test_speculative_fields_per_request(client: Any, server: LiveServer) -> None:
    """The speculative_* fields reach the engine: outputs do not depend on them, bad values (and MTP
    on a model without MTP layers) are 400s naming the field."""
    prompt = "Repeat exactly: one two three four five one two three four five"
    plain = _chat(client, server, prompt, extra_body={"speculative_source": "off"})
    drafted = _chat(
        client, server, prompt, extra_body={"speculative_source": "ngram", "speculative_tokens": 3}
    )
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    for body, field in (
        ({"speculative_source": "mtp"}, "speculative_source"),
        ({"speculative_tokens": 40}, "speculative_tokens"),
        ({"speculative_confidence": -1}, "speculative_confidence"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            _chat(client, server, "hi", extra_body=body)
        assert field in str(info.value)
