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
| ``bootstrap_*`` | a 400: this server is not a prefill or decode worker |
"""

from __future__ import annotations

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
    for name in BOOTSTRAP_FIELDS:
        if getattr(req, name) is not None:
            raise ApiError(
                400,
                f"{name} is only accepted by prefill/decode workers; this server colocates prefill and "
                "decode (run the router without --pd-disaggregation)",
                param=name,
                code="not_a_pd_worker",
            )
