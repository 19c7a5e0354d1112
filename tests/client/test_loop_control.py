"""The SDK's loop control: options, what a retry after a ``length`` failure changes, and the wire body."""

from __future__ import annotations

from typing import Any

import pytest

from agent_infer.client import STRUCTURED_LOOP_CONTROL, Client, LoopControl
from agent_infer.client.generation import generate_flow
from agent_infer.client.loop_control import resolve
from agent_infer.client.remote import request_body
from agent_infer.client.request import Constraint, ModelRequest, ModelResponse, Usage
from agent_infer.errors import InvalidRequestError


def test_bad_settings_name_the_field(llm: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        LoopControl(dry_base=0.5)
    assert info.value.field == "dry_base"
    with pytest.raises(InvalidRequestError) as info:
        Client.from_llm(llm).generate("x", choice=["a"], loop_control="on")  # type: ignore[arg-type]
    assert info.value.field == "loop_control"


def test_resolution_and_escalation() -> None:
    assert resolve(None, structured=True) == STRUCTURED_LOOP_CONTROL
    assert resolve(None, structured=False) is None
    assert resolve(False, structured=True) is None
    mine = LoopControl(dry_multiplier=0.5, dry_allowed_length=4)
    assert resolve(mine, structured=False) == mine
    twice = resolve(mine, structured=True, escalation=2)
    assert twice is not None
    assert (twice.dry_multiplier, twice.dry_allowed_length) == (2.0, 2)
    assert resolve(False, structured=True, escalation=3) is None


def _flow_requests(first: ModelRequest, responses: list[ModelResponse], retries: int) -> list[ModelRequest]:
    flow = generate_flow(first, retries)
    sent = []
    op = next(flow)
    for response in responses:
        sent.append(op)
        op = flow.send(response)
        while not isinstance(op, ModelRequest):  # parse-error events for the hooks
            op = flow.send(None)
    return [*sent, op]


def test_length_retry_keeps_the_conversation_and_escalates() -> None:
    constraint = Constraint.from_keywords(schema={"type": "object"})
    first = ModelRequest([{"role": "user", "content": "q"}], constraint, temperature=0.7, seed=5)
    cut = ModelResponse({"role": "assistant", "content": '{"a": 1111'}, "length", Usage(1, 200, 1))
    sent = _flow_requests(first, [cut, cut], retries=2)
    assert [r.messages for r in sent] == [first.messages] * 3
    assert [r.loop_escalation for r in sent] == [0, 1, 2]
    assert [r.seed for r in sent] == [5, 6, 7]
    assert [r.temperature for r in sent] == [0.7, 0.35, 0.175]
    assert [r.loop_last_attempt for r in sent] == [False, False, True]


def test_length_retry_without_loop_control_shows_the_output() -> None:
    constraint = Constraint.from_keywords(schema={"type": "object"})
    first = ModelRequest([{"role": "user", "content": "q"}], constraint, loop_control=False, seed=5)
    cut = ModelResponse({"role": "assistant", "content": '{"a": 1111'}, "length", Usage(1, 200, 1))
    second = _flow_requests(first, [cut], retries=1)[1]
    assert len(second.messages) == 3 and second.messages[1]["content"] == '{"a": 1111'
    assert (second.seed, second.loop_escalation, second.loop_last_attempt) == (5, 0, False)


def test_validation_retry_shows_the_error() -> None:
    constraint = Constraint.from_keywords(choice=["yes", "no"])
    first = ModelRequest([{"role": "user", "content": "q"}], constraint)
    wrong = ModelResponse({"role": "assistant", "content": "maybe"}, "stop", Usage(1, 2, 1))
    second = _flow_requests(first, [wrong], retries=1)[1]
    assert len(second.messages) == 3 and second.loop_escalation == 0


def test_wire_body_sends_dry_fields_only_when_given() -> None:
    constraint = Constraint.from_keywords(schema={"type": "object"})
    plain = ModelRequest([{"role": "user", "content": "q"}], constraint)
    assert not any(k.startswith("dry_") for k in request_body("m", plain, False))
    mine = LoopControl(dry_multiplier=1.0, dry_sequence_breakers=("\n",))
    body = request_body("m", ModelRequest(plain.messages, constraint, loop_control=mine), False)
    assert body["dry_multiplier"] == 1.0 and body["dry_sequence_breakers"] == ["\n"]
    assert "close_on_length" not in body
    last = ModelRequest(
        plain.messages, constraint, loop_control=mine, loop_escalation=2, loop_last_attempt=True
    )
    body = request_body("m", last, False)
    assert body["close_on_length"] is True and body["dry_multiplier"] == 4.0


def test_budget_pressure_only_where_no_retry_follows() -> None:
    constraint = Constraint.from_keywords(schema={"type": "object"})
    first = ModelRequest([{"role": "user", "content": "q"}], constraint, temperature=0.7, seed=5)
    cut = ModelResponse({"role": "assistant", "content": '{"a": 1111'}, "length", Usage(1, 200, 1))
    sent = _flow_requests(first, [cut, cut], retries=2)
    assert [r.retried_on_length for r in sent] == [True, True, False]
    assert _flow_requests(first, [], retries=0)[0].retried_on_length is False
    on = resolve(None, structured=True)
    assert on is not None and on.value_close_budget == STRUCTURED_LOOP_CONTROL.value_close_budget > 0
    retried = resolve(None, structured=True, retried=True)
    assert retried is not None and retried.value_close_budget == 0.0
    # The same rule for a LoopControl given explicitly, on the wire too.
    mine = LoopControl(value_close_budget=0.5)
    body = request_body(
        "m", ModelRequest(first.messages, constraint, loop_control=mine, retried_on_length=True), False
    )
    assert body["value_close_budget"] == 0.0
    body = request_body("m", ModelRequest(first.messages, constraint, loop_control=mine), False)
    assert (
        body["value_close_budget"] == 0.5 and body["value_close_budget_bias"] == mine.value_close_budget_bias
    )
