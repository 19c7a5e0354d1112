"""Bad requests get the right status and a message naming the problem; the server keeps serving."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from server_harness import LiveServer, server_fixture

from agent_infer.server import ServerConfig

openai = pytest.importorskip("openai")

KEY = "s3cret-key"


server = server_fixture(ServerConfig(api_key=KEY, max_body_bytes=64 * 1024, max_tokens_limit=512))


def _post(server: LiveServer, body: Any, path: str = "/chat/completions", **kw: Any) -> httpx.Response:
    headers = kw.pop("headers", {"Authorization": f"Bearer {KEY}"})
    if isinstance(body, (bytes, str)):
        return httpx.post(
            server.v1 + path,
            content=body,
            headers={**headers, "Content-Type": "application/json"},
            timeout=60,
            **kw,
        )
    return httpx.post(server.v1 + path, json=body, headers=headers, timeout=60, **kw)


def _chat_body(server: LiveServer, **fields: Any) -> dict[str, Any]:
    return {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"]
    return error


def _schema_body(server: LiveServer, schema: Any) -> dict[str, Any]:
    return _chat_body(
        server,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": True},
        },
    )


def test_malformed_json(server: LiveServer) -> None:
    error = _error(_post(server, b'{"model": "x", "messages": [}'), 400)
    assert "not valid JSON" in error["message"]


def test_unknown_top_level_field(server: LiveServer) -> None:
    error = _error(_post(server, _chat_body(server, temprature=0.5)), 400)
    assert error["param"] == "temprature" and "unknown field" in error["message"]


def test_unknown_nested_field(server: LiveServer) -> None:
    body = _chat_body(
        server,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "stirct": True}},
    )
    error = _error(_post(server, body), 400)
    assert error["param"] == "response_format.json_schema.stirct"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": "4"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"stream": "yes"}, "stream"),
        ({"messages": "hello"}, "messages"),
        ({"top_p": 1.5}, "top_p"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ],
)
def test_wrong_types_name_the_field(server: LiveServer, fields: dict[str, Any], param: str) -> None:
    error = _error(_post(server, _chat_body(server, **fields)), 400)
    assert error["param"] == param, error


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 17}, "n"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {"abc": 5}}, "logit_bias.abc"),
        ({"logit_bias": {"1": 101}}, "logit_bias.1"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias.99999999"),
        ({"min_tokens": 5}, "min_tokens"),  # more than max_tokens (4)
        ({"max_tokens": 100000}, "max_tokens"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        (
            {"messages": [{"role": "user", "content": "x", "reasoning_content": "y"}]},
            "messages.0.reasoning_content",
        ),
    ],
)
def test_unsupported_values_are_rejected_by_name(
    server: LiveServer, fields: dict[str, Any], param: str
) -> None:
    error = _error(_post(server, _chat_body(server, **fields)), 400)
    assert error["param"] == param, error


def test_unsupported_schema_keyword_names_keyword_and_pointer(server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"$dynamicRef": "#m"}}}}
    error = _error(_post(server, _schema_body(server, schema)), 400)
    assert "$dynamicRef" in error["message"] and "/properties/tags/items/$dynamicRef" in error["message"]
    assert error["param"] == "response_format.json_schema.schema"
    assert error["code"] == "unsupported_schema"
    assert error["keyword"] == "$dynamicRef" and error["pointer"] == "/properties/tags/items/$dynamicRef"


def test_invalid_schema_names_the_pointer(server: LiveServer) -> None:
    error = _error(_post(server, _schema_body(server, {"type": "string", "minLength": "x"})), 400)
    assert "/minLength" in error["message"] and error["code"] == "invalid_schema"
    assert error["pointer"] == "/minLength"


def test_bad_grammar_and_regex(server: LiveServer) -> None:
    error = _error(_post(server, _chat_body(server, structured_outputs={"grammar": "root ::= ("})), 400)
    assert error["param"] == "structured_outputs.grammar" and "line" in error["message"]
    assert error["code"] == "grammar_syntax" and error["line"] == 1 and error["column"] >= 1
    error = _error(_post(server, _chat_body(server, structured_outputs={"regex": "(?<=a)b"})), 400)
    assert error["param"] == "structured_outputs.regex"
    assert error["code"] == "unsupported_regex" and error["position"] == 0


def test_bad_tool_schema_names_the_tool(server: LiveServer) -> None:
    ok = {"type": "function", "function": {"name": "ok", "parameters": {"type": "object"}}}
    bad = {
        "type": "function",
        "function": {
            "name": "bad",
            "strict": True,
            "parameters": {"type": "object", "properties": {"x": {"type": "string", "format": "iri"}}},
        },
    }
    error = _error(_post(server, _chat_body(server, tools=[ok, bad], tool_choice="required")), 400)
    assert error["param"] == "tools.1.function.parameters"
    assert "format" in error["message"] and "/properties/x/format" in error["message"]


def test_tool_schema_annotations_are_reported(server: LiveServer) -> None:
    params = {"type": "object", "properties": {"x": {"type": "string", "format": "cidr", "maxLength": 4}}}
    tool = {"type": "function", "function": {"name": "net", "strict": True, "parameters": params}}
    resp = _post(server, _chat_body(server, tools=[tool], tool_choice="required", max_tokens=30))
    assert resp.status_code == 200
    assert json.loads(resp.headers["x-agent-infer-warnings"]) == [
        "tool 'net': ignored unknown format 'cidr' at /properties/x/format: treated as an annotation"
    ]


def test_unknown_model_is_404(server: LiveServer) -> None:
    error = _error(_post(server, _chat_body(server, model="gpt-9")), 404)
    assert error["param"] == "model"


def test_oversized_body_is_413(server: LiveServer) -> None:
    body = _chat_body(server, messages=[{"role": "user", "content": "x" * 100_000}])
    error = _error(_post(server, body), 413)
    assert "limit" in error["message"]


def test_api_key_required_and_compared(server: LiveServer) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"}):
        resp = httpx.post(
            server.v1 + "/chat/completions", json=_chat_body(server), headers=headers, timeout=30
        )
        assert _error(resp, 401)["code"] == "invalid_api_key"
    assert httpx.get(server.v1 + "/models", timeout=30).status_code == 401
    bad_client = openai.OpenAI(base_url=server.v1, api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_client.models.list()


def test_openai_client_sees_bad_request(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.v1, api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "x"}], n=99)
    assert "limit of 16 choices" in str(info.value)


def test_server_still_serves_after_bad_requests(server: LiveServer) -> None:
    _post(server, b"\xff\xfe garbage")
    _post(server, _schema_body(server, {"type": "array", "items": {"$dynamicRef": "#m"}}))
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
    resp = _post(server, _chat_body(server, temperature=0))
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] is not None
    metrics = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert 'status="400"' in metrics and 'status="401"' in metrics
    assert json.loads(resp.text)["usage"]["completion_tokens"] <= 4


def test_non_text_content_part_is_unsupported(server: LiveServer) -> None:
    part = {"type": "image_url", "image_url": {"url": "http://example.invalid/cat.png"}}
    body = _chat_body(server, messages=[{"role": "user", "content": [{"type": "text", "text": "see"}, part]}])
    error = _error(_post(server, body), 400)
    assert error["param"] == "messages.0.content.1" and "image_url" in error["message"]


def test_lenient_schema_reports_what_it_skipped(server: LiveServer) -> None:
    schema = {"type": "object", "properties": {"t": {"type": "array", "items": {"$dynamicRef": "#m"}}}}
    body = _chat_body(
        server,
        max_tokens=20,
        temperature=0,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": schema, "strict": False},
        },
    )
    resp = _post(server, body)
    assert resp.status_code == 200
    warnings = json.loads(resp.headers["x-agent-infer-warnings"])
    assert any("$dynamicRef" in w and "/properties/t/items/$dynamicRef" in w for w in warnings)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field", ["response_format", "structured_outputs"])
def test_strict_schema_reports_ignored_annotations(server: LiveServer, stream: bool, field: str) -> None:
    schema = {
        "type": "object",
        "properties": {"c": {"type": "string", "format": "hex-colour", "maxLenght": 2}},
    }
    constraint = (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        if field == "response_format"
        else {"structured_outputs": {"json": schema}}
    )
    resp = _post(server, _chat_body(server, max_tokens=5, temperature=0, stream=stream, **constraint))
    assert resp.status_code == 200
    assert sorted(json.loads(resp.headers["x-agent-infer-warnings"])) == [
        "ignored unknown format 'hex-colour' at /properties/c/format: treated as an annotation",
        "ignored unknown keyword maxLenght at /properties/c/maxLenght: treated as an annotation "
        "(did you mean 'maxLength'?)",
    ]


@pytest.mark.parametrize("strict", [True, False])
def test_unknown_formats_error_is_a_400_naming_the_pointer(server: LiveServer, strict: bool) -> None:
    schema = {"type": "object", "properties": {"c": {"type": "string", "format": "hex-colour"}}}
    spec = {"name": "x", "schema": schema, "strict": strict, "unknown_formats": "error"}
    error = _error(
        _post(server, _chat_body(server, response_format={"type": "json_schema", "json_schema": spec})), 400
    )
    assert error["param"] == "response_format.json_schema.schema"
    assert error["pointer"] == "/properties/c/format" and "unknown format 'hex-colour'" in error["message"]
    spec["unknown_formats"] = "fail"
    error = _error(
        _post(server, _chat_body(server, response_format={"type": "json_schema", "json_schema": spec})), 400
    )
    assert "unknown_formats" in error["param"]


@pytest.mark.parametrize("stream", [False, True])
def test_constraint_failing_at_compile_is_400_not_200(server: LiveServer, stream: bool) -> None:
    # Parses, lowers, then exceeds the compiler's limits: wherever the engine compiles it (at once or
    # in a worker), the client gets a 400 naming the field, never a 200 with unconstrained text.
    body = _chat_body(server, stream=stream, structured_outputs={"grammar": 'root ::= "a"{3000000000}'})
    error = _error(_post(server, body), 400)
    assert error["param"] == "structured_outputs.grammar" and "too large" in error["message"]


def test_prompt_longer_than_the_cache_names_messages(server: LiveServer) -> None:
    body = _chat_body(server, messages=[{"role": "user", "content": "word " * 3000}])
    error = _error(_post(server, body), 400)
    assert error["param"] == "messages" and "tokens" in error["message"]
