"""The Responses API event stream: output items opened, filled by deltas and closed as the
chat pipeline's content and tool-call deltas arrive (``sequence_number`` counts every event)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from agent_infer.engine.output import RequestOutput
from agent_infer.errors import AgentInferError
from agent_infer.server.streaming import DONE, IncrementalText, error_event, sse

if TYPE_CHECKING:
    from agent_infer.server.responses import _Run


def message_item(text: str) -> dict[str, Any]:
    """An assistant ``message`` output item holding ``text``."""
    return {
        "type": "message",
        "id": "msg_" + uuid.uuid4().hex,
        "status": "completed",
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def reasoning_item(text: str) -> dict[str, Any]:
    """A ``reasoning`` output item holding the model's thinking as ``reasoning_text``."""
    return {
        "type": "reasoning",
        "id": "rs_" + uuid.uuid4().hex,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A ``function_call`` output item."""
    return {
        "type": "function_call",
        "id": "fc_" + uuid.uuid4().hex,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }


async def response_events(run: _Run, first: RequestOutput, stream: Any) -> AsyncIterator[bytes]:
    """The Responses SSE sequence: created, in_progress, item and part events with text and
    argument deltas, then completed (or incomplete); an engine failure is an error event."""
    seq = 0

    def event(kind: str, **fields: Any) -> bytes:
        nonlocal seq
        seq += 1
        return b"event: " + kind.encode() + b"\n" + sse({"type": kind, "sequence_number": seq - 1, **fields})

    items: list[dict[str, Any]] = []
    open_text: dict[str, Any] | None = None
    open_call: dict[str, Any] | None = None
    open_reasoning: dict[str, Any] | None = None

    def close() -> list[bytes]:
        nonlocal open_text, open_call, open_reasoning
        out: list[bytes] = []
        index = len(items) - 1
        if open_reasoning is not None:
            out.append(
                event(
                    "response.reasoning_text.done",
                    item_id=open_reasoning["id"],
                    output_index=index,
                    content_index=0,
                    text=open_reasoning["content"][0]["text"],
                )
            )
            out.append(event("response.output_item.done", output_index=index, item=open_reasoning))
            open_reasoning = None
        if open_text is not None:
            part = open_text["content"][0]
            out.append(
                event(
                    "response.output_text.done",
                    item_id=open_text["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                )
            )
            out.append(
                event(
                    "response.content_part.done",
                    item_id=open_text["id"],
                    output_index=index,
                    content_index=0,
                    part=part,
                )
            )
            out.append(event("response.output_item.done", output_index=index, item=open_text))
            open_text = None
        if open_call is not None:
            out.append(
                event(
                    "response.function_call_arguments.done",
                    item_id=open_call["id"],
                    output_index=index,
                    arguments=open_call["arguments"],
                )
            )
            out.append(event("response.output_item.done", output_index=index, item=open_call))
            open_call = None
        return out

    finished = False
    try:
        yield event("response.created", response=run.body([], None, "in_progress"))
        yield event("response.in_progress", response=run.body([], None, "in_progress"))
        text = IncrementalText(run.params.stop_strings)
        output = first
        while True:
            for choice in run.responder.increment(text.advance(output), output):
                delta = choice["delta"]
                if delta.get("reasoning_content"):
                    if open_reasoning is None:
                        for chunk in close():
                            yield chunk
                        open_reasoning = reasoning_item("")
                        open_reasoning["status"] = "in_progress"
                        items.append(open_reasoning)
                        yield event(
                            "response.output_item.added",
                            output_index=len(items) - 1,
                            item={**open_reasoning, "content": []},
                        )
                    open_reasoning["content"][0]["text"] += delta["reasoning_content"]
                    yield event(
                        "response.reasoning_text.delta",
                        item_id=open_reasoning["id"],
                        output_index=len(items) - 1,
                        content_index=0,
                        delta=delta["reasoning_content"],
                    )
                if delta.get("content"):
                    if open_text is None:
                        for chunk in close():
                            yield chunk
                        open_text = message_item("")
                        open_text["status"] = "in_progress"
                        items.append(open_text)
                        index = len(items) - 1
                        yield event(
                            "response.output_item.added",
                            output_index=index,
                            item={**open_text, "content": []},
                        )
                        yield event(
                            "response.content_part.added",
                            item_id=open_text["id"],
                            output_index=index,
                            content_index=0,
                            part={"type": "output_text", "text": "", "annotations": []},
                        )
                    open_text["content"][0]["text"] += delta["content"]
                    yield event(
                        "response.output_text.delta",
                        item_id=open_text["id"],
                        output_index=len(items) - 1,
                        content_index=0,
                        delta=delta["content"],
                        logprobs=[],
                    )
                for call in delta.get("tool_calls") or []:
                    if call.get("id") is not None:
                        for chunk in close():
                            yield chunk
                        open_call = call_item(call["id"], call["function"]["name"], "")
                        open_call["status"] = "in_progress"
                        items.append(open_call)
                        yield event(
                            "response.output_item.added", output_index=len(items) - 1, item=dict(open_call)
                        )
                    fragment = call["function"].get("arguments") or ""
                    if fragment and open_call is not None:
                        open_call["arguments"] += fragment
                        yield event(
                            "response.function_call_arguments.delta",
                            item_id=open_call["id"],
                            output_index=len(items) - 1,
                            delta=fragment,
                        )
            if output.finished:
                finished = True
                reason = output.finish_reason
                if reason in ("error", "abort"):
                    yield error_event(
                        output.outputs[0].error or f"request ended: {reason}", reason or "error"
                    )
                    yield DONE
                    return
                for item in items:
                    item["status"] = "completed"
                for chunk in close():
                    yield chunk
                body = run.finish(items, output)
                kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
                yield event(kind, response=body)
                yield DONE
                return
            output = await stream.next()
    except AgentInferError as exc:
        yield error_event(str(exc), type(exc).__name__)
        yield DONE
    finally:
        run.state.release(run.id, finished)
