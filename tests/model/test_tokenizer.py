"""Tokenizer built from GGUF metadata: round trips, special tokens, chat template, and llama.cpp parity.

llama.cpp (via llama-cpp-python) is the reference tokenizer for a GGUF file. transformers' GGUF
converter also agrees except on non-ASCII digits (it lacks the SmolLM digit split), so it is not used.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_infer.errors import TokenizerError
from agent_infer.model.loader import default_model_path
from agent_infer.model.loading.gguf_reader import GGUFFile
from agent_infer.model.tokenizer import Tokenizer, UnsupportedTokenizerError

TEXTS = [
    "Hello world!",
    "  leading spaces\n\n\ttabs",
    "héllo wörld ñ 日本語 emoji 🤖👍🏽",
    "The year 2024 had 365 days and 3.14159",
    "a<|im_end|>b<|im_start|>user",
    "don't you're I'LL 's 'S",
    "\n\n\n",
    " ",
    "",
    "x  y   z",
    "def f(x):\n    return x**2\n",
    "١٢٣ Arabic digits ²³ and ½",
    "   \n  \n",
    "Ünïcödé ©®™ — “quotes” ‘x’",
    "ｆｕｌｌ　ｗｉｄｔｈ",
    "\u200b zero width",
    '{"name": "Ada", "age": 36, "tags": ["a", "b"]}',
]


@pytest.fixture(scope="module")
def meta() -> dict:
    return GGUFFile(default_model_path()).metadata


@pytest.fixture(scope="module")
def tok(meta: dict) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(meta)


def test_basic_properties(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)
    assert tok.special_token_ids == frozenset(range(17))
    assert tok.hf_tokenizer.token_to_id("<|im_end|>") == 2


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_digits_are_split_individually(tok: Tokenizer) -> None:
    ids = tok.encode("12345")
    assert len(ids) == 5
    assert [tok.decode([i]) for i in ids] == list("12345")


def test_special_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"  # skip_special_tokens=True by default
    # this GGUF sets add_bos_token = false, so add_special_tokens adds nothing
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


def test_matches_llama_cpp(tok: Tokenizer) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    ref = llama_cpp.Llama(model_path=str(default_model_path()), vocab_only=True, verbose=False)
    for text in TEXTS:
        assert tok.encode(text) == ref.tokenize(text.encode(), add_bos=False, special=True), text


def test_chat_template(tok: Tokenizer) -> None:
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")
    no_prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert no_prompt.endswith("<|im_end|>\n")


def test_template_helpers_and_errors(meta: dict) -> None:
    template = (
        "{% if messages|length > 2 %}{{ raise_exception('too many') }}{% endif %}"
        "{{ strftime_now('%Y') | length }}|{{ tools | tojson }}|{{ bos_token }}"
    )
    tok = Tokenizer.from_gguf_metadata({**meta, "tokenizer.chat_template": template})
    assert tok.apply_chat_template([], tools=[{"name": "<f>"}]) == '4|[{"name": "<f>"}]|<|im_start|>'
    with pytest.raises(TokenizerError, match="too many"):
        tok.apply_chat_template([{}, {}, {}])
    with pytest.raises(TokenizerError):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.chat_template": "{% if %}"}).apply_chat_template([])


def test_end_of_turn_token_joins_eos(meta: dict) -> None:
    # a ChatML template whose file EOS is <|endoftext|>: <|im_end|> must still stop generation
    tok = Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.eos_token_id": 0})
    assert tok.eos_token_ids == (0, 2)


def test_unsupported_tokenizer_kinds(meta: dict) -> None:
    with pytest.raises(UnsupportedTokenizerError, match="'bert'"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.model": "bert"})
    # SentencePiece files with stored merges (a byte-level vocabulary relabelled) are not read as SentencePiece
    with pytest.raises(UnsupportedTokenizerError, match="SentencePiece vocabularies with stored merges"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.model": "llama"})
    with pytest.raises(UnsupportedTokenizerError, match="made-up"):
        Tokenizer.from_gguf_metadata({**meta, "tokenizer.ggml.pre": "made-up"})


def test_from_hf_dir(tok: Tokenizer, tmp_path: Path) -> None:
    tok.hf_tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": None, "chat_template": tok.chat_template})
    )
    hf = Tokenizer.from_hf_dir(tmp_path)
    assert hf.eos_token_ids == (2,) and hf.bos_token_id is None
    for text in TEXTS:
        assert hf.encode(text) == tok.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert hf.apply_chat_template(msgs) == tok.apply_chat_template(msgs)
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path / "nowhere")
