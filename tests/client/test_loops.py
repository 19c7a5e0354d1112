"""One regression per loop kind seen on the default model: greedy, the output loops inside a value and
ends ``length`` without loop control, and ends ``stop`` with the SDK's default loop control."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from pydantic import BaseModel, Field

from agent_infer.client import Client, Hooks, LoopControl, ResponseEvent
from agent_infer.errors import ValidationRetryError


class Stats(BaseModel):
    country: str
    population: int
    gdp_usd: float


class Contact(BaseModel):
    name: str
    email: str = Field(json_schema_extra={"format": "email"})
    phone: str | None = None


class Taxon(BaseModel):
    name: str
    children: list[Taxon]


class Inventory(BaseModel):
    counts: dict[str, int]


class Product(BaseModel):
    name: str
    price: float
    in_stock: bool
    tags: list[str]


CASES = {
    # "gdp_usd": 12.18888888...
    "digits": (Stats, "Give the population of India and its GDP in US dollars.", 120),
    # "c.dubois@...": "deboudeboudebou..."
    "email": (
        Contact,
        "Claire Dubois runs the Lyon office; her address is c.dubois@atelier.fr. Extract the contact.",
        200,
    ),
    # {"name": ..., "children": [{"name": ..., "children": [ ... nested forever
    "recursion": (
        Taxon,
        "Plant is the root. Its only child is Tree, and Tree's only child is Oak, a leaf. "
        "Build the taxonomy tree.",
        300,
    ),
    # "figs": 1, "figs": 1, "figs": 1, ...
    "dict-keys": (
        Inventory,
        "Stock count this morning: 3 apples, 5 pears and 2 melons. Extract the counts per item.",
        200,
    ),
}


# The default loop control without its closing pressure near max_tokens (on for a call no retry
# follows, as with max_retries=0): what ends each loop here is the loop machinery itself.
LOOPS_ONLY = LoopControl(value_close_budget=0.0)


@pytest.fixture(scope="module")
def client(llm: Any) -> Client:
    return Client.from_llm(llm)


def _finish_reasons(
    client: Client, case: str, loop_control: Any, numbers: str = "float64"
) -> tuple[list[str], Any]:
    schema, prompt, max_tokens = CASES[case]
    reasons: list[str] = []

    def on_response(event: ResponseEvent) -> None:
        reasons.append(event.finish_reason)

    try:
        value = client.generate(
            prompt,
            schema=schema,
            max_tokens=max_tokens,
            max_retries=0,
            loop_control=loop_control,
            numbers=numbers,
            hooks=Hooks(on_response=on_response),
        )
    except ValidationRetryError:
        value = None
    return reasons, value


@pytest.mark.parametrize("case", list(CASES))
def test_loop_ends_with_loop_control(client: Client, case: str) -> None:
    # numbers="exact": without the float64 digit policy, so the digit loop is there to end.
    reasons, value = _finish_reasons(client, case, False, numbers="exact")
    assert reasons == ["length"] and value is None
    reasons, value = _finish_reasons(client, case, LOOPS_ONLY)
    assert reasons == ["stop"]
    assert isinstance(value, CASES[case][0])


def test_the_number_policy_alone_ends_a_digit_loop(client: Client) -> None:
    reasons, value = _finish_reasons(client, "digits", False)
    assert reasons == ["stop"] and isinstance(value, Stats)


# Values that vary instead of repeating exactly: DRY alone leaves them at max_tokens, the closing
# bias (engine/value_loops.py) ends them.
VARYING = {
    # "legal@okafor-partners.ng" becomes "ngozi-ngoza-2022-22-22/ngozakaguru-..." (no "@" yet)
    "email": (
        Contact,
        "Please send the signed contract to Ngozi Okafor, legal@okafor-partners.ng, phone 0803 555 2210. "
        "Extract the contact.",
    ),
    # "tags": ["2017-12-24", "2016-12-25", "2015-12-26", ... counting down
    "list": (Product, "Steel kettle, 24.5, currently out of stock, tagged kitchen. Extract the product."),
}


@pytest.mark.parametrize("case", list(VARYING))
def test_closing_bias_ends_varying_loops(client: Client, case: str) -> None:
    schema, prompt = VARYING[case]
    dry_only = LoopControl(value_close_multiplier=0.0, value_close_budget=0.0)
    for loop_control, expected in ((dry_only, ["length"]), (LOOPS_ONLY, ["stop"])):
        reasons: list[str] = []
        with contextlib.suppress(ValidationRetryError):
            client.generate(
                prompt,
                schema=schema,
                max_tokens=200,
                max_retries=0,
                loop_control=loop_control,
                hooks=Hooks(on_response=lambda event, seen=reasons: seen.append(event.finish_reason)),
            )
        assert reasons == expected


def test_budget_pressure_completes_a_tool_call_started_late(make_llm: Any) -> None:
    # After one complete call the model starts a second one it cannot finish within max_tokens:
    # without the pressure the output is cut inside that call; with it the model ends after the first.
    from agent_infer.errors import IncompleteToolCallError

    def send_email(to: str, subject: str, body: str) -> str:
        """Send an e-mail."""
        return "sent"

    def get_weather(city: str) -> str:
        """Current weather for a city."""
        return "sunny"

    prompt = (
        "Send an email to bob@example.com with the subject 'Report' and a body that describes the "
        "quarterly results in detail."
    )
    # Prefix caching off: the prompt is computed the same way whatever ran before.
    client = Client.from_llm(make_llm(enable_prefix_caching=False))
    ask = dict(tools=[send_email, get_weather], tool_choice="required", max_tokens=80)
    with pytest.raises(IncompleteToolCallError):
        client.chat(prompt, loop_control=LoopControl(value_close_budget=0.0), **ask)  # type: ignore[arg-type]
    message, completion = client.chat_with_completion(prompt, **ask)  # type: ignore[arg-type]
    assert completion.finish_reason == "tool_calls"
    calls = message["tool_calls"]
    assert calls and calls[0]["function"]["name"] == "send_email"
