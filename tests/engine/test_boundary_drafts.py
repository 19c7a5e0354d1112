"""Boundary drafts: the forced text jump-forward leaves to the model, drafted in the model's own split
(history, then memory)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agent_infer import SamplingParams
from agent_infer.engine import boundary_drafts
from agent_infer.engine.boundary_drafts import SplitMemory, boundary_tokens, history_split
from agent_infer.structured import StructuredOutput

# Three string fields: after the first, each key's boundary text '":"' has occurred before.
CONTACT = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "city": {"type": "string", "maxLength": 30},
        "email": {"type": "string", "maxLength": 40},
        "country": {"type": "string", "maxLength": 30},
    },
    "required": ["name", "city", "email", "country"],
    "additionalProperties": False,
}
CONTACT_PROMPT = [
    {
        "role": "user",
        "content": "Give a JSON object with the name, city, email and country of a person living in Paris.",
    }
]


@pytest.fixture(scope="module")
def info(loaded_model: Any) -> Any:
    from agent_infer.grammar import TokenizerInfo

    tok = loaded_model.tokenizer
    return TokenizerInfo.from_tokenizer(tok.hf_tokenizer, eos_token_ids=sorted(tok.eos_token_ids))


def _ids(info: Any, *pieces: str) -> list[int]:
    """One token id per piece (each piece must be a single token of the vocabulary)."""
    out = []
    for piece in pieces:
        ids = info.encode(piece)
        assert len(ids) == 1, (piece, ids)
        out.append(ids[0])
    return out


def test_boundary_tokens_are_the_forced_text_left_to_the_model(info: Any) -> None:
    """After jump-forward the grammar still fixes some text (its last token could merge with what
    follows); the boundary draft is that text's canonical tokenization, and drafting it leaves the
    matcher where it was."""
    from agent_infer.grammar import GrammarCompiler, GrammarMatcher

    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    m = GrammarMatcher(GrammarCompiler(info).compile_json_schema(schema, whitespace="compact"))
    jumped = m.forced_tokens()
    for t in jumped:
        assert m.accept_token(t)
    forced, _ = m.find_forced_bytes()
    assert b'{"name":"'.startswith(b"".join(info.token_bytes(t) for t in jumped) + forced)
    assert forced  # the boundary: jump-forward did not take all of '{"name":"'
    before = m.num_accepted_steps
    draft = boundary_tokens(m)
    assert m.num_accepted_steps == before
    assert draft == info.encode(forced.decode())
    assert b"".join(info.token_bytes(t) for t in draft) == forced
    for t in draft:
        assert m.accept_token(t)
    assert m.find_forced_bytes()[0] == b""  # the draft covers the whole forced text
    m.rollback(len(draft))
    assert boundary_tokens(m) == draft


def test_history_split_finds_the_latest_split_of_the_text(info: Any) -> None:
    split, quote, colon_quote = _ids(info, '":', '"', '":"')
    name, city, hello = _ids(info, "name", "city", "hello")
    tb = info.token_bytes
    # The model wrote '":' then '"' after "name": that split is drafted for the next key.
    assert history_split(b'":"', [name, split, quote, hello], tb) == [split, quote]
    # The latest occurrence wins over an earlier, different split.
    history = [name, colon_quote, hello, city, split, quote, hello]
    assert history_split(b'":"', history, tb) == [split, quote]
    assert history_split(b'":"', [name, split, quote, hello, city, colon_quote, hello], tb) == [colon_quote]
    # The model merged the text's end into the next token ('"hello'): only the run before it is known.
    merged = info.encode('"hello')[0]
    if info.token_bytes(merged) == b'"hello':
        assert history_split(b'":"', [name, split, merged], tb) == [split]
    # Never written: no split (the caller falls back to the canonical tokens).
    assert history_split(b'":"', [name, hello, city], tb) is None
    assert history_split(b'":"', [], tb) is None
    # A run that breaks off with a token not continuing the text is no occurrence.
    assert history_split(b'":"', [split, hello], tb) is None
    # The prefix-token filter finds the same runs without decoding every position.
    firsts = SplitMemory().prefix_tokens(b'":"', info)
    assert {split, quote, colon_quote} <= firsts
    assert all(b'":"'.startswith(tb(t)) and tb(t) for t in firsts)
    assert history_split(b'":"', history, tb, firsts) == [split, quote]
    assert history_split(b'":"', [name, hello, city], tb, firsts) is None


def test_split_memory_keeps_the_latest_split_within_its_capacity() -> None:
    memory = SplitMemory(capacity=2)
    memory.put(b'":"', [1, 2])
    memory.put(b'","', [3])
    assert memory.get(b'":"') == [1, 2]  # now the most recent
    memory.put(b'"}', [4])  # evicts '","', the least recent
    assert memory.get(b'","') is None
    assert memory.get(b'":"') == [1, 2] and memory.get(b'"}') == [4]
    memory.put(b'":"', [5])
    assert memory.get(b'":"') == [5]


def test_model_split_drafts_keep_the_tokens_and_are_accepted_more_often(
    make_llm: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy outputs are the same whichever split is drafted (verification is exact); drafting the
    split the model used before is accepted at least as often as the canonical one, here more."""
    structured = StructuredOutput.json_schema(CONTACT, whitespace="compact")
    params = SamplingParams(temperature=0.0, max_tokens=100, structured=structured)

    def run() -> tuple[Any, Any]:
        llm = make_llm(enable_prefix_caching=False, speculative_tokens=0, boundary_drafts=True)
        ids = llm.tokenizer.encode(
            llm.tokenizer.apply_chat_template(CONTACT_PROMPT, add_generation_prompt=True)
        )
        return llm, llm.generate([ids], params)[0]

    llm, model_split = run()
    # The engine remembers the split for later requests, whose own history has none yet.
    remembered = llm.engine.speculator.splits.get(b'":"')
    assert remembered is not None
    assert b"".join(llm.engine.grammar.compiler.tokenizer_info.token_bytes(t) for t in remembered) == b'":"'
    monkeypatch.setattr(boundary_drafts, "history_split", lambda *args: None)
    _, canonical = run()
    assert model_split.outputs[0].finish_reason == "stop"
    assert model_split.outputs[0].token_ids == canonical.outputs[0].token_ids
    assert model_split.metrics.num_accepted_draft_tokens > canonical.metrics.num_accepted_draft_tokens
