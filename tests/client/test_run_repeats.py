"""The run loop with repeated identical calls: each distinct call runs once, in one turn or across
turns, every copy gets the first result, and a repeat makes the next turn answer.

The loop is driven with scripted model answers (the model is not what is tested here: which calls
a small model repeats is not reproducible on purpose); the tools are real functions.
"""

from __future__ import annotations

import json
from typing import Any

from agent_infer.client.agent import RunResult, ToolBatch, execute, run_flow
from agent_infer.client.request import ModelRequest, ModelResponse, Usage
from agent_infer.tools import as_tools


def _call(i: int, country: str) -> dict[str, Any]:
    args = json.dumps({"country": country})
    return {"id": f"c{i}", "type": "function", "function": {"name": "lookup", "arguments": args}}


def _answer(*calls: dict[str, Any], text: str = "") -> ModelResponse:
    message = {"role": "assistant", "content": text, "tool_calls": list(calls)}
    return ModelResponse(message, "tool_calls" if calls else "stop", Usage(1, 1, 1))


def _run(answers: list[ModelResponse]) -> tuple[RunResult, list[ModelRequest], list[str]]:
    executed: list[str] = []

    def lookup(country: str) -> str:
        """Capital of a country."""
        executed.append(country)
        return {"France": "Paris", "Peru": "Lima"}[country]

    request = ModelRequest([{"role": "user", "content": "Capitals?"}], tool_choice="required")
    flow = run_flow(request, as_tools([lookup]), None, max_turns=5, max_tool_retries=1)
    sent: list[ModelRequest] = []
    scripted = iter(answers)
    op = next(flow)
    try:
        while True:
            if isinstance(op, ModelRequest):
                sent.append(op)
                op = flow.send(next(scripted))
            elif isinstance(op, ToolBatch):
                op = flow.send([execute(c) for c in op.calls])
            else:
                op = flow.send(None)
    except StopIteration as stop:
        return stop.value, sent, executed


def test_copies_in_one_turn_run_once_and_the_next_turn_answers() -> None:
    result, sent, executed = _run(
        [_answer(_call(0, "France"), _call(1, "France"), _call(2, "Peru")), _answer(text="Paris and Lima.")]
    )
    assert executed == ["France", "Peru"]
    results = [m["content"] for m in result.transcript if m["role"] == "tool"]
    assert results == ["Paris", "Paris", "Lima"]
    assert [r.tool_choice for r in sent] == ["required", "none"]
    assert result.output == "Paris and Lima."


def test_distinct_calls_keep_the_tool_choice() -> None:
    _, sent, executed = _run([_answer(_call(0, "France")), _answer(_call(1, "Peru")), _answer(text="Done.")])
    assert executed == ["France", "Peru"]
    assert [r.tool_choice for r in sent] == ["required", "required", "required"]


def test_a_call_repeated_in_a_later_turn_is_answered_from_the_first_result() -> None:
    result, sent, executed = _run(
        [_answer(_call(0, "France")), _answer(_call(1, "France")), _answer(text="Paris.")]
    )
    assert executed == ["France"]
    assert [m["content"] for m in result.transcript if m["role"] == "tool"] == ["Paris", "Paris"]
    assert [r.tool_choice for r in sent] == ["required", "required", "none"]
