"""Native tool-call formats: render/parse round trips, streaming at every split, grammars, prompts."""

from __future__ import annotations

import json
import random
from enum import Enum
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, Field

from agent_infer.grammar.ir import Grammar
from agent_infer.testing import assert_accepts, assert_rejects, random_strings
from agent_infer.tool_formats import (
    ContentDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallFormat,
    deepseek,
    get_format,
    hermes,
    llama3,
)
from agent_infer.tools import Tool, ToolDefinitionError, tool


@tool
def get_weather(city: str, unit: Literal["c", "f"] = "c") -> str:
    """Current weather in a city."""
    return city


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class Seat(Enum):
    AISLE = "aisle"
    WINDOW = "window"


class Traveler(BaseModel):
    name: Annotated[str, Field(max_length=12)]
    age: int | None = None
    seat: Seat = Seat.AISLE


@tool
def book(
    destination: str,
    travelers: list[Traveler],
    nights: Annotated[int, Field(ge=1, le=30)] = 1,
    notes: dict[str, str] | None = None,
) -> str:
    """Book a trip (nested models, $defs, enums, bounds: the argument grammar has many rules)."""
    return destination


TOOLS = [get_weather, add, book]
NAMES = ["hermes", "llama3_json", "deepseek_v3", "deepseek_v31"]
WEATHER = ToolCall("get_weather", {"city": 'Paris </tool_call>; {"x'})
ADD = ToolCall("add", {"a": 1, "b": -2})


@pytest.fixture(params=NAMES)
def fmt(request: pytest.FixtureRequest) -> ToolCallFormat:
    return get_format(request.param)


def random_calls(seed: int, n: int) -> list[list[ToolCall]]:
    """Lists of 1-3 calls whose arguments are drawn from each tool's own argument grammar."""
    pools = {}
    for t in TOOLS:
        texts = random_strings(Grammar.from_json_schema(t.parameters), 3 * n, seed, max_repeat=4)
        # Lone surrogates (from \\ud800 escapes) cannot be written as UTF-8 text; models never emit them.
        values = [json.loads(s) for s in texts]
        pools[t.name] = [
            v
            for v in values
            if json.dumps(v, ensure_ascii=False).encode("utf-8", "ignore").decode()
            == json.dumps(v, ensure_ascii=False)
        ]
    rng = random.Random(seed)
    return [
        [ToolCall(name, rng.choice(pools[name])) for name in rng.choices(list(pools), k=rng.randint(1, 3))]
        for _ in range(n)
    ]


def collect(fmt: ToolCallFormat, chunks: list[str]) -> tuple[str, list[tuple[str, Any]], list[Any]]:
    """Feed ``chunks`` to a stream parser: (content, [(name, arguments)], events)."""
    parser = fmt.stream_parser()
    events = [e for chunk in chunks for e in parser.feed(chunk)] + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls: dict[int, list[str]] = {}
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.index not in calls:
                assert e.name is not None and e.id is not None, "the first delta of a call names it"
                calls[e.index] = [e.name, ""]
            else:
                assert e.name is None and e.id is None
            calls[e.index][1] += e.arguments
    return content, [(name, json.loads(args)) for name, args in calls.values()], events


def expected(fmt: ToolCallFormat, text: str) -> tuple[str, list[tuple[str, Any]]]:
    parsed = fmt.parse(text)
    return parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]


def transcripts(fmt: ToolCallFormat) -> list[str]:
    calls = fmt.render_assistant_tool_calls([WEATHER, ADD])
    texts = [calls, fmt.render_assistant_tool_calls([ADD]), "Plain answer with a < b and {braces}.\n", "  "]
    if not isinstance(fmt, llama3.Llama3JsonFormat):  # Llama replies are either text or calls, not both
        texts += [
            f"Let me check <tool.\n\n{calls}",
            f"{calls}\n\nDone. <｜tool▁calls",
            "<tool_call>\n{bad}\n</tool_call>",
        ]
    else:
        texts += [f"{llama3.PYTHON_TAG}{calls}", '{"answer": 42}', f" {calls}\n"]
    return texts


# --- render / parse -------------------------------------------------------------------------------


def test_round_trip_random_calls(fmt: ToolCallFormat) -> None:
    grammar = fmt.grammar(TOOLS)
    required = fmt.grammar(TOOLS, tool_choice="required")
    for calls in random_calls(seed=NAMES.index(fmt.name), n=6):
        text = fmt.render_assistant_tool_calls(calls)
        assert fmt.parse(text).tool_calls == calls
        assert fmt.parse(text).content == ""
        assert_accepts(grammar, text)
        assert_accepts(required, text)


def test_content_before_calls_is_kept(fmt: ToolCallFormat) -> None:
    if isinstance(fmt, llama3.Llama3JsonFormat):
        pytest.skip("Llama replies are either text or calls")
    text = "I'll check <b>a < b</b>.\n\n" + fmt.render_assistant_tool_calls([WEATHER])
    parsed = fmt.parse(text)
    assert parsed.content == "I'll check <b>a < b</b>." and parsed.tool_calls == [WEATHER]
    assert_accepts(fmt.grammar(TOOLS), text)
    assert_rejects(fmt.grammar(TOOLS, tool_choice="required"), text)


def test_malformed_calls_stay_text() -> None:
    h = get_format("hermes")
    bad = "<tool_call>\n{bad}\n</tool_call>"
    assert h.parse(bad).content == bad and h.parse(bad).tool_calls == []
    # Other key orders and "parameters" are read, though they only stream once complete.
    odd = '<tool_call>\n{"arguments": {"a": 1, "b": 2}, "name": "add"}\n</tool_call>'
    assert h.parse(odd).tool_calls == [ToolCall("add", {"a": 1, "b": 2})]
    llama = get_format("llama3_json")
    assert llama.parse('{"answer": 42}').content == '{"answer": 42}'
    # Calls stay calls when junk follows them (a stream may have sent them already).
    after = llama.parse(llama.render_assistant_tool_calls([ADD]) + "; and then?")
    assert after.tool_calls == [ADD] and after.content == "and then?"
    truncated = get_format("deepseek_v31").render_assistant_tool_calls([ADD])[:-30]
    assert get_format("deepseek_v31").parse(truncated).tool_calls == []


def test_openai_shapes() -> None:
    assert ADD.to_openai()["function"] == {"name": "add", "arguments": '{"a": 1, "b": -2}'}
    first = ToolCallDelta(0, id="call_1", name="add").to_openai()
    assert first == {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": ""},
    }
    assert ToolCallDelta(0, arguments='{"a"').to_openai() == {"index": 0, "function": {"arguments": '{"a"'}}


# --- streaming ------------------------------------------------------------------------------------


def test_stream_equals_parse_at_every_split_point(fmt: ToolCallFormat) -> None:
    for text in transcripts(fmt):
        want = expected(fmt, text)
        for cut in range(len(text) + 1):
            assert collect(fmt, [text[:cut], text[cut:]])[:2] == want, (text, cut)


def test_stream_equals_parse_for_random_chunkings(fmt: ToolCallFormat) -> None:
    rng = random.Random(7)
    for text in transcripts(fmt):
        want = expected(fmt, text)
        assert collect(fmt, list(text))[:2] == want
        for _ in range(5):
            cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 8))))
            chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
            assert collect(fmt, chunks)[:2] == want


def test_stream_equals_parse_on_fragment_soup(fmt: ToolCallFormat) -> None:
    """Random mixes of delimiters, their prefixes, JSON bits and whole calls, cut at random points."""
    rng = random.Random(11)
    fragments = [
        hermes.CALL_OPEN,
        hermes.CALL_CLOSE,
        "<tool_",
        "\n",
        " ",
        "{",
        "}",
        "x",
        '"name"',
        "; ",
        deepseek.CALLS_BEGIN,
        deepseek.CALL_BEGIN,
        deepseek.CALLS_END,
        deepseek.CALLS_BEGIN[:5],
        llama3.PYTHON_TAG,
        fmt.render_assistant_tool_calls([ADD]),
    ]
    for _ in range(300):
        text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 6)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, 3)))
        chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert collect(fmt, chunks)[:2] == expected(fmt, text), chunks


def test_parsed_arguments_text_equals_concatenated_stream_deltas(fmt: ToolCallFormat) -> None:
    """Whatever spacing the model writes, the whole answer reports the argument text the deltas add up to."""
    for raw in ['{"a":1,"b":-2}', '{\n  "a" : 1,\n  "b": -2\n}', '{"a": 1.0e0, "b": -2, "s": "\\u00e9"}']:
        text = fmt.render_assistant_tool_calls([ADD]).replace('{"a": 1, "b": -2}', raw)
        (call,) = fmt.parse(text).tool_calls
        assert call.to_openai()["function"]["arguments"] == raw
        assert call == ToolCall("add", json.loads(raw))
        for cut in range(len(text) + 1):
            parser = fmt.stream_parser()
            events = parser.feed(text[:cut]) + parser.feed(text[cut:]) + parser.finish()
            streamed = "".join(e.arguments for e in events if isinstance(e, ToolCallDelta))
            assert streamed == raw, (text, cut)
        cut_off = fmt.parse_cut_off(text + fmt.render_assistant_tool_calls([ADD])[:-3])
        assert cut_off.tool_calls[0].to_openai()["function"]["arguments"] == raw


def test_stream_names_a_call_before_its_arguments_end(fmt: ToolCallFormat) -> None:
    text = fmt.render_assistant_tool_calls([WEATHER])
    cut = text.index("Paris") + 3  # mid-argument
    parser = fmt.stream_parser()
    events = parser.feed(text[:cut])
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    assert deltas[0].name == "get_weather"
    assert "".join(d.arguments for d in deltas).endswith('"Par')


# --- grammars -------------------------------------------------------------------------------------


def test_grammar_modes(fmt: ToolCallFormat) -> None:
    one = fmt.render_assistant_tool_calls([ADD])
    two = fmt.render_assistant_tool_calls([ADD, WEATHER])
    auto, required = fmt.grammar(TOOLS), fmt.grammar(TOOLS, tool_choice="required")
    assert_accepts(auto, "Just text.")
    assert_accepts(auto, "")
    assert_rejects(required, "Just text.")
    assert_rejects(required, one + " and more")
    assert_rejects(auto, one + "trailing text")
    single = fmt.grammar(TOOLS, parallel_tool_calls=False)
    assert_accepts(single, one)
    assert_rejects(single, two)
    named = fmt.grammar(TOOLS, tool_choice={"type": "function", "function": {"name": "add"}})
    assert_accepts(named, one)
    assert_rejects(named, fmt.render_assistant_tool_calls([WEATHER]))
    assert_rejects(named, two)
    assert_accepts(
        fmt.grammar(TOOLS, tool_choice={"name": "get_weather"}), fmt.render_assistant_tool_calls([WEATHER])
    )
    none = fmt.grammar(TOOLS, tool_choice="none")
    assert_accepts(none, "Only words.")
    assert_rejects(none, one)


@pytest.mark.parametrize(
    "bad",
    [
        ToolCall("delete_everything", {"a": 1, "b": 2}),  # unknown tool
        ToolCall("add", {"a": "1", "b": 2}),  # wrong type
        ToolCall("add", {"a": 1}),  # missing required
        ToolCall("add", {"a": 1, "b": 2, "c": 3}),  # extra property
        ToolCall("get_weather", {"city": "Oslo", "unit": "kelvin"}),  # not in the enum
        ToolCall("book", {"destination": "Rome", "travelers": [{"name": "a" * 13}]}),  # nested maxLength
        ToolCall("book", {"destination": "Rome", "travelers": [], "nights": 31}),  # maximum
    ],
    ids=["unknown-name", "wrong-type", "missing", "extra", "enum", "nested", "bound"],
)
def test_grammar_rejects_invalid_calls(fmt: ToolCallFormat, bad: ToolCall) -> None:
    assert_rejects(fmt.grammar(TOOLS), fmt.render_assistant_tool_calls([bad]))


def test_free_text_cannot_open_a_call() -> None:
    assert_rejects(get_format("hermes").grammar(TOOLS), "see <tool_call> here")
    assert_rejects(get_format("deepseek_v31").grammar(TOOLS), f"x {deepseek.CALLS_BEGIN}")
    for text in ('{"answer": 1}', " leading space", llama3.PYTHON_TAG + "print(1)"):
        assert_rejects(get_format("llama3_json").grammar(TOOLS, tool_choice="none"), text)
    assert_accepts(get_format("llama3_json").grammar(TOOLS), "<b>not a tag</b> {}")


def test_compact_whitespace_grammar() -> None:
    g = get_format("deepseek_v31").grammar(TOOLS, whitespace="compact")
    assert_accepts(
        g,
        f'{deepseek.CALLS_BEGIN}{deepseek.CALL_BEGIN}add{deepseek.SEP}{{"a":1,"b":2}}{deepseek.CALL_END}{deepseek.CALLS_END}',
    )
    assert_rejects(g, get_format("deepseek_v31").render_assistant_tool_calls([ADD]))


def test_bad_tool_choice() -> None:
    f = get_format("hermes")
    with pytest.raises(ToolDefinitionError, match="not one of the tools"):
        f.grammar(TOOLS, tool_choice={"name": "nope"})
    with pytest.raises(ToolDefinitionError, match="tool_choice"):
        f.grammar(TOOLS, tool_choice="sometimes")
    with pytest.raises(ToolDefinitionError, match="at least one tool"):
        f.grammar([], tool_choice="required")


def test_formats_reuse_tool_objects() -> None:
    spec_only = Tool.from_openai(add.to_openai())
    text = get_format("hermes").render_assistant_tool_calls([ADD])
    assert_accepts(get_format("hermes").grammar([spec_only]), text)


def test_stream_does_not_rescan_settled_output() -> None:
    f = get_format("hermes")
    parser = f.stream_parser()
    parser.feed("Intro text. " + f.render_assistant_tool_calls([ADD]) + "\nmore")
    assert parser._base > len("Intro text. ")  # the finished call is settled
    tail = parser.feed(" words") + parser.finish()
    assert "".join(e.text for e in tail if isinstance(e, ContentDelta)) == " words"
    assert (
        f.parse("Intro text. " + f.render_assistant_tool_calls([ADD]) + "\nmore words").content
        == "Intro text.\nmore words"
    )
