"""``--reasoning-parser deepseek_r1``: thinking split into ``reasoning_content``, whole and streamed,
constraints on the answer only, tool calls from the answer only, and the Responses reasoning item."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from server_harness import LiveServer, openai_client, server_fixture

from agent_infer.cli import main
from agent_infer.errors import ConfigError
from agent_infer.grammar.ir import Grammar
from agent_infer.server import ServerConfig
from agent_infer.server.reasoning import ReasoningSplit, ReasoningStream, split_reasoning, think_then
from agent_infer.testing import assert_accepts, assert_rejects

openai = pytest.importorskip("openai")

TEXTS = [
    "",
    "<think>",
    "<think></think>",
    "<think>plan</think>answer",
    "plan</think>answer",
    "plan</think>",
    "<think>a < b </thin and </think>x</think>y",
    "no closing tag, all thinking",
    "<thin",
    "</think",
    '<think>\nstep 1\n</think>\n\n{"a": 1}',
]


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("<think>plan</think>answer", ReasoningSplit("plan", "answer")),
        ("plan</think>answer", ReasoningSplit("plan", "answer")),  # the template opened the thinking
        ("<think>plan", ReasoningSplit("plan", None)),  # cut before the answer: all thinking
        ("</think>answer", ReasoningSplit(None, "answer")),
        ("<think>plan</think>", ReasoningSplit("plan", None)),
        ("a</think>b</think>c", ReasoningSplit("a", "b</think>c")),  # the first tag ends the thinking
        ("", ReasoningSplit(None, None)),
    ],
)
def test_split_reasoning(text: str, want: ReasoningSplit) -> None:
    assert split_reasoning(text) == want


def _streamed(chunks: list[str]) -> ReasoningSplit:
    stream = ReasoningStream()
    parts = [stream.feed(c) for c in chunks] + [stream.finish()]
    reasoning = "".join(r for r, _ in parts)
    content = "".join(c for _, c in parts)
    return ReasoningSplit(reasoning or None, content or None)


def test_stream_split_equals_whole_split_at_every_split_point() -> None:
    rng = random.Random(5)
    for text in TEXTS:
        want = split_reasoning(text)
        assert _streamed(list(text)) == want, text
        for cut in range(len(text) + 1):
            assert _streamed([text[:cut], text[cut:]]) == want, (text, cut)
        for _ in range(10):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 3)))
            assert _streamed([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]) == want


def test_stream_never_sends_a_tag_as_reasoning() -> None:
    stream = ReasoningStream()
    sent = [stream.feed(c)[0] for c in "<think>ab</think>c"]
    assert "".join(sent) == "ab"
    assert all("<" not in s and ">" not in s for s in sent)


def test_think_then_constrains_the_answer_only() -> None:
    grammar = think_then(Grammar.from_regex("yes|no"))
    for text in ["</think>yes", "<think>free < text > here</think>no", "x</thinkk</think>yes"]:
        assert_accepts(grammar, text)
    for text in ["yes", "<think>x</think>maybe", "<think>x</think>", "<think>x", "a</think>b</think>yes"]:
        assert_rejects(grammar, text)


def test_unknown_reasoning_parser_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="qwen3")
    with pytest.raises(SystemExit):
        main(["serve", "--reasoning-parser", "qwen3"])
    assert "--reasoning-parser" in capsys.readouterr().err


# --- over the wire, with the real default model -----------------------------------------------------

server = server_fixture(ServerConfig(reasoning_parser="deepseek_r1"))
ASK = [{"role": "user", "content": "Is the sky blue?"}]
# close_on_length ends a constrained request with the grammar's shortest completion: the model
# thinks for a few tokens, then the grammar closes the thinking and gives the answer, which forces
# the shape <think>...</think>ANSWER on a model that was never trained to think.
FORCED: dict[str, Any] = {
    "temperature": 0,
    "max_tokens": 8,
    "extra_body": {"structured_outputs": {"regex": "yes|no"}, "close_on_length": True},
}


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    return openai_client(server)


def _stream(
    client: Any, server: LiveServer, **kw: Any
) -> tuple[str, str, dict[int, dict[str, str]], list[str]]:
    reasoning = content = ""
    calls: dict[int, dict[str, str]] = {}
    finishes = []
    for chunk in client.chat.completions.create(model=server.model, stream=True, **kw):
        choice = chunk.choices[0]
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
        reasoning += getattr(choice.delta, "reasoning_content", None) or ""
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    return reasoning, content, calls, finishes


def test_thinking_is_reasoning_content_and_the_constraint_holds_for_the_answer(
    client: Any, server: LiveServer
) -> None:
    whole = client.chat.completions.create(model=server.model, messages=ASK, **FORCED).choices[0]
    message = whole.message
    assert message.content in ("yes", "no")
    assert message.reasoning_content and "</think>" not in message.reasoning_content
    assert whole.finish_reason == "stop"
    reasoning, content, _, finishes = _stream(client, server, messages=ASK, **FORCED)
    assert (reasoning, content, finishes) == (message.reasoning_content, message.content, ["stop"])


def test_unfinished_thinking_has_no_answer(client: Any, server: LiveServer) -> None:
    kw: dict[str, Any] = {"temperature": 0, "max_tokens": 6}
    whole = client.chat.completions.create(model=server.model, messages=ASK, **kw).choices[0]
    assert whole.finish_reason == "length"
    assert whole.message.content is None and whole.message.reasoning_content
    reasoning, content, _, _ = _stream(client, server, messages=ASK, **kw)
    assert (reasoning, content) == (whole.message.reasoning_content, "")


def test_tool_calls_come_from_the_answer(client: Any, server: LiveServer) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
    kw: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Add 2 and 3."}],
        "tools": [tool],
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 60,  # room for the thinking to be closed and the shortest call written
        "extra_body": {"close_on_length": True},
    }
    whole = client.chat.completions.create(model=server.model, **kw).choices[0]
    assert whole.finish_reason == "tool_calls"
    (call,) = whole.message.tool_calls
    assert call.function.name == "add" and set(json.loads(call.function.arguments)) == {"a", "b"}
    assert whole.message.reasoning_content and "<tool_call>" not in (whole.message.content or "")
    reasoning, content, calls, finishes = _stream(client, server, **kw)
    assert finishes == ["tool_calls"] and reasoning == whole.message.reasoning_content
    assert content == (whole.message.content or "")
    assert calls == {0: {"name": "add", "arguments": call.function.arguments}}


def test_responses_api_reports_a_reasoning_item(client: Any, server: LiveServer) -> None:
    kw: dict[str, Any] = {"model": server.model, "input": "Is the sky blue?", "max_output_tokens": 6}
    resp = client.responses.create(temperature=0, **kw)
    assert resp.status == "incomplete"
    (item,) = resp.output
    assert item.type == "reasoning" and item.content[0].type == "reasoning_text"
    thinking = item.content[0].text
    assert thinking
    events = list(client.responses.create(temperature=0, stream=True, **kw))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = [e for e in events if e.type == "response.reasoning_text.done"]
    assert deltas == thinking and [e.text for e in done] == [thinking]
    final = events[-1].response
    assert [o.type for o in final.output] == ["reasoning"] and final.output[0].content[0].text == thinking
    # An echoed reasoning item is accepted and stays out of the prompt.
    follow = client.responses.create(
        temperature=0,
        model=server.model,
        input=[*[o.model_dump(exclude_none=True) for o in resp.output], {"role": "user", "content": "Why?"}],
        max_output_tokens=2,
    )
    assert follow.output[0].type == "reasoning"
