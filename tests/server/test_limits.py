"""Request-body limits: 64-bit integers, nesting depth, one invalid-JSON code, deep schemas, tools."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_harness import LiveServer, server_fixture

from agent_infer.server import ServerConfig
from agent_infer.server.body import MAX_BODY_DEPTH
from agent_infer.server.protocol import ChatCompletionRequest, CompletionRequest

KEY = "limits-key"
AUTH = {"Authorization": f"Bearer {KEY}"}

server = server_fixture(ServerConfig(api_key=KEY, max_tokens_limit=64))


def _post(server: LiveServer, body: Any, path: str = "/chat/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**AUTH, "Content-Type": "application/json"}
    return httpx.post(server.v1 + path, content=content, headers=headers, timeout=60)


def _chat(server: LiveServer, **fields: Any) -> dict[str, Any]:
    return {"model": server.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, **fields}


def _text(server: LiveServer, **fields: Any) -> dict[str, Any]:
    return {"model": server.model, "prompt": "Hi", "max_tokens": 1, **fields}


def _error(resp: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert error["message"]
    return error


HUGE = 1180591620717411303424  # 2**70

# (endpoint, fields, param): every integer field of the request models, out of its range.
OUT_OF_RANGE = [
    ("chat", {"seed": HUGE}, "seed"),
    ("chat", {"seed": 2**63}, "seed"),
    ("chat", {"seed": -(2**63) - 1}, "seed"),
    ("chat", {"max_tokens": HUGE}, "max_tokens"),
    ("chat", {"max_tokens": None, "max_completion_tokens": HUGE}, "max_completion_tokens"),
    ("chat", {"n": HUGE}, "n"),
    ("chat", {"min_tokens": HUGE}, "min_tokens"),
    ("chat", {"top_k": HUGE}, "top_k"),
    ("chat", {"top_k": -2}, "top_k"),
    ("chat", {"logprobs": True, "top_logprobs": HUGE}, "top_logprobs"),
    ("chat", {"stop_token_ids": [HUGE]}, "stop_token_ids.0"),
    ("chat", {"stop_token_ids": [-1]}, "stop_token_ids.0"),
    ("chat", {"dry_allowed_length": HUGE}, "dry_allowed_length"),
    ("chat", {"dry_penalty_last_n": HUGE}, "dry_penalty_last_n"),
    ("chat", {"dry_penalty_last_n": -2}, "dry_penalty_last_n"),
    ("chat", {"value_close_allowed": HUGE}, "value_close_allowed"),
    ("chat", {"value_close_allowed": -1}, "value_close_allowed"),
    ("chat", {"speculative_tokens": HUGE}, "speculative_tokens"),
    ("chat", {"speculative_tokens": -1}, "speculative_tokens"),
    ("chat", {"bootstrap_port": 65536}, "bootstrap_port"),
    ("chat", {"bootstrap_room": HUGE}, "bootstrap_room"),
    ("chat", {"bootstrap_room": -1}, "bootstrap_room"),
    ("text", {"seed": HUGE}, "seed"),
    ("text", {"max_tokens": HUGE}, "max_tokens"),
    ("text", {"n": HUGE}, "n"),
    ("text", {"min_tokens": HUGE}, "min_tokens"),
    ("text", {"top_k": HUGE}, "top_k"),
    ("text", {"stop_token_ids": [HUGE]}, "stop_token_ids.0"),
    ("text", {"logprobs": HUGE}, "logprobs"),
    ("text", {"best_of": HUGE}, "best_of"),
    ("text", {"dry_allowed_length": HUGE}, "dry_allowed_length"),
    ("text", {"dry_penalty_last_n": HUGE}, "dry_penalty_last_n"),
    ("text", {"value_close_allowed": HUGE}, "value_close_allowed"),
    ("text", {"prompt": [1, HUGE]}, "prompt.1"),
    ("text", {"speculative_tokens": 33}, "speculative_tokens"),
    ("text", {"bootstrap_port": -1}, "bootstrap_port"),
    ("text", {"bootstrap_room": HUGE}, "bootstrap_room"),
]


@pytest.mark.parametrize(("endpoint", "fields", "param"), OUT_OF_RANGE)
def test_out_of_range_integers_are_400_naming_the_field(
    server: LiveServer, endpoint: str, fields: dict[str, Any], param: str
) -> None:
    if endpoint == "chat":
        resp = _post(server, _chat(server, **fields))
    else:
        resp = _post(server, _text(server, **fields), "/completions")
    error = _error(resp)
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def _int_fields(model: type[Any]) -> set[str]:
    found = set()
    for name, info in model.model_fields.items():
        if re.search(r"\bint\b", str(info.annotation)) or any(
            a is int for a in typing.get_args(info.annotation)
        ):
            found.add(name)
    return found


def test_every_integer_field_is_checked_out_of_range() -> None:
    # A new integer field must join OUT_OF_RANGE (and get bounds) to pass.
    covered = {(endpoint, param.split(".")[0]) for endpoint, _, param in OUT_OF_RANGE}
    wanted = {("chat", f) for f in _int_fields(ChatCompletionRequest)}
    wanted |= {("text", f) for f in _int_fields(CompletionRequest)}
    assert wanted <= covered, sorted(wanted - covered)


@pytest.mark.parametrize("seed", [-(2**63), 2**63 - 1])
def test_64_bit_seeds_are_served(server: LiveServer, seed: int) -> None:
    resp = _post(server, _chat(server, seed=seed, temperature=1.0))
    assert resp.status_code == 200, resp.text


def _nested(depth: int, kind: str) -> bytes:
    inner = ('{"a":' * depth + "1" + "}" * depth) if kind == "object" else ("[" * depth + "]" * depth)
    return f'{{"model": "m", "messages": {inner}}}'.encode()


@pytest.mark.parametrize("depth", [MAX_BODY_DEPTH, 300, 1_000, 100_000])
@pytest.mark.parametrize("kind", ["array", "object"])
def test_deep_bodies_are_400_naming_the_limit(server: LiveServer, depth: int, kind: str) -> None:
    error = _error(_post(server, _nested(depth, kind)))
    assert error["code"] == "json_too_deep"
    assert f"limit of {MAX_BODY_DEPTH} levels" in error["message"]
    # The body is one line; level MAX_BODY_DEPTH + 1 opens MAX_BODY_DEPTH levels below "messages".
    step = 5 if kind == "object" else 1
    column = len('{"model": "m", "messages": ') + 1 + MAX_BODY_DEPTH * step - step
    assert f"(line 1, column {column})" in error["message"], error


def test_bodies_at_the_depth_limit_reach_validation(server: LiveServer) -> None:
    error = _error(_post(server, _nested(MAX_BODY_DEPTH - 1, "array")))
    assert error["code"] != "json_too_deep" and error["param"] is not None, error


def test_brackets_inside_strings_do_not_count(server: LiveServer) -> None:
    text = '[{"' * 200 + '\\"]' * 50
    resp = _post(server, _chat(server, messages=[{"role": "user", "content": text}]))
    assert resp.status_code == 200, resp.text


def test_deep_schema_is_a_typed_400(server: LiveServer) -> None:
    schema: Any = {"type": "integer"}
    for _ in range(MAX_BODY_DEPTH):
        schema = {"type": "array", "items": schema}
    format_ = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    error = _error(_post(server, _chat(server, response_format=format_)))
    assert error["code"] == "json_too_deep"


def test_schema_over_the_front_ends_nesting_limit_names_the_pointer(server: LiveServer) -> None:
    # Shallow JSON, deep references: the compiler's $ref/allOf limit, not the body's, applies.
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(80)}
    defs["d80"] = {"type": "integer"}
    schema = {"$defs": defs, "$ref": "#/$defs/d0"}
    format_ = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    error = _error(_post(server, _chat(server, response_format=format_)))
    assert error["code"] == "grammar_limit" and error["param"] == "response_format.json_schema.schema"
    assert re.search(r"at /\$defs/d\d+", error["message"]), error


def _with_arguments(server: LiveServer, arguments: str) -> dict[str, Any]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
    ]
    return _chat(server, messages=messages)


def _with_schema_text(server: LiveServer, text: str) -> dict[str, Any]:
    return _chat(server, structured_outputs={"json": text})


@pytest.mark.parametrize(
    ("make", "param"),
    [
        (_with_arguments, "messages.1.tool_calls.0.function.arguments"),
        (_with_schema_text, "structured_outputs.json"),
    ],
)
@pytest.mark.parametrize("depth", [MAX_BODY_DEPTH + 1, 100_000])
def test_deep_json_text_in_string_fields_is_400_naming_the_field(
    server: LiveServer, make: Any, param: str, depth: int
) -> None:
    error = _error(_post(server, make(server, "[" * depth + "]" * depth)))
    assert error["code"] == "json_too_deep" and error["param"] == param, error
    assert f"(line 1, column {MAX_BODY_DEPTH + 1})" in error["message"], error


@pytest.mark.parametrize(
    ("make", "param"),
    [
        (_with_arguments, "messages.1.tool_calls.0.function.arguments"),
        (_with_schema_text, "structured_outputs.json"),
    ],
)
def test_invalid_json_text_in_string_fields_names_the_field(
    server: LiveServer, make: Any, param: str
) -> None:
    error = _error(_post(server, make(server, '{"a": NaN}')))
    assert error["code"] == "invalid_json" and error["param"] == param, error


@pytest.mark.parametrize(
    "body",
    [
        b'{"model": "m", "messages": [}',
        b'{"model": "m", "messages": [], "temperature": NaN}',
        b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}',
        b"\xff\xfe garbage",
    ],
)
def test_invalid_json_has_one_code(server: LiveServer, body: bytes) -> None:
    error = _error(_post(server, body))
    assert error["code"] == "invalid_json" and "not valid JSON" in error["message"], error


def test_401_names_the_bearer_scheme(server: LiveServer) -> None:
    resp = httpx.post(server.v1 + "/chat/completions", json=_chat(server), timeout=30)
    assert _error(resp, 401)["code"] == "invalid_api_key"
    assert resp.headers["www-authenticate"] == "Bearer"
    assert httpx.get(server.v1 + "/models", timeout=30).headers["www-authenticate"] == "Bearer"


def test_405_names_the_allowed_method(server: LiveServer) -> None:
    resp = httpx.get(server.v1 + "/chat/completions", headers=AUTH, timeout=30)
    assert _error(resp, 405)["type"] == "invalid_request_error"
    assert resp.headers["allow"] == "POST"


def test_duplicate_tool_names_are_400_naming_the_duplicate(server: LiveServer) -> None:
    def tool(name: str) -> dict[str, Any]:
        return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}

    error = _error(_post(server, _chat(server, tools=[tool("f"), tool("g"), tool("f")])))
    assert error["param"] == "tools.2.function.name" and "'f'" in error["message"], error
    assert error["code"] == "duplicate_tool_name"


def _documented_metrics() -> set[str]:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    section = doc.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    names = set()
    for cell in re.findall(r"^\| (.+?) \|", section, re.MULTILINE):
        previous = ""
        for name in re.findall(r"`([a-z_{},]+)`", cell):
            name = name.split("{")[0]
            # "`agent_infer_kv_blocks_total`, `_free`": a suffix continues the previous name.
            if name.startswith("_") and previous:
                name = previous.rsplit("_", 1)[0] + name
            names.add(name)
            previous = name
    return names


def test_docs_list_exactly_the_exported_metrics(server: LiveServer) -> None:
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    exported = set(re.findall(r"^# TYPE (\S+) ", text, re.MULTILINE))
    assert _documented_metrics() == exported
    doc = (Path(__file__).resolve().parents[2] / "docs" / "server.md").read_text()
    assert "not yet exported" not in doc.lower()
