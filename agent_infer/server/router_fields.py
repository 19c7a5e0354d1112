"""SGLang's request extensions, as sglang-router adds them to every request it forwards.

sglang-router (0.3.x) rewrites each chat request with ``no_stop_trim``, ``ignore_eos``,
``continue_final_message``, ``skip_special_tokens``, ``separate_reasoning``, ``stream_reasoning``
and ``return_hidden_states`` (text completions get the first, second, fourth and last), and in
prefill/decode mode with ``bootstrap_host``, ``bootstrap_port`` and ``bootstrap_room``. Each is
honoured, or rejected by value when its value would change the output in a way this server
cannot produce; none is dropped silently:

| field | honoured as |
|---|---|
| ``ignore_eos`` | ``SamplingParams.ignore_eos`` |
| ``no_stop_trim`` | ``SamplingParams.include_stop_str_in_output`` (the stop string stays in the text) |
| ``skip_special_tokens`` | ``SamplingParams.skip_special_tokens`` |
| ``separate_reasoning`` | ``false``: the reasoning parser's thinking stays in ``content`` |
| ``stream_reasoning`` | ``true`` (streamed thinking deltas); ``false`` with a reasoning parser on a stream is a 400 |
| ``continue_final_message`` | ``false`` only; ``true`` is a 400 |
| ``return_hidden_states`` | ``false`` only; ``true`` is a 400 |
| ``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room`` | all three or none; on a worker started with ``--disaggregation-mode prefill`` or ``decode`` they name the handoff (``server/pd/``), elsewhere a 400 (``code: "not_a_pd_worker"``) |
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent_infer.server.errors import ApiError

#: The bootstrap fields sglang-router's PD mode adds to both halves of a request.
BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def check_router_fields(req: Any) -> None:
    """Reject the SGLang extension values this server cannot honour, naming the field."""
    if req.return_hidden_states:
        raise ApiError(
            400,
            "return_hidden_states=true is unsupported: this server returns no hidden states",
            param="return_hidden_states",
        )
    if getattr(req, "continue_final_message", None):
        raise ApiError(
            400,
            "continue_final_message=true is unsupported: the prompt always ends with a new assistant turn",
            param="continue_final_message",
        )


@dataclass(frozen=True)
class Bootstrap:
    """The PD fields sglang-router adds to both halves of a request: where the prefill worker's
    bootstrap endpoint is, and the room (a random 64-bit id) that pairs the two halves."""

    host: str
    port: int
    room: int


def bootstrap_of(req: Any) -> Bootstrap | None:
    """The request's bootstrap fields (all three or none, else a 400 naming the missing one)."""
    given = [getattr(req, name) for name in BOOTSTRAP_FIELDS]
    if all(v is None for v in given):
        return None
    for name, value in zip(BOOTSTRAP_FIELDS, given):
        if value is None:
            raise ApiError(400, f"{name} is required with the other bootstrap fields", param=name)
    return Bootstrap(str(req.bootstrap_host), int(req.bootstrap_port), int(req.bootstrap_room))
