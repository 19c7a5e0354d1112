"""End-to-end engine behaviour on the real default model (small max_tokens keeps it quick)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from agent_infer.engine.output import RequestOutput
from agent_infer.errors import ConfigError, InvalidRequestError, PromptTooLongError
from agent_infer.llm import LLM
from agent_infer.sampling_params import SamplingParams

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "List three prime numbers:",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a great forest, there lived",
    "Q: What is 12 times 12?\nA:",
    "The quick brown fox",
    "In physics, the law of conservation of energy states that the total energy of an isolated system",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
LONG_PREFIX = (
    "You are a careful assistant. Answer briefly and precisely. Use plain words. "
    "Never invent facts; say you do not know instead. Here is background material: "
    "the river flows north through three towns, each with a bridge and a market square. "
)


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.token_ids for o in outputs]


def test_generate_returns_text_tokens_and_length_finish(llm: LLM) -> None:
    (out,) = llm.generate("The capital of France is", SamplingParams(temperature=0.0, max_tokens=6))
    assert out.finished and out.finish_reason == "length"
    assert len(out.token_ids) == 6 and out.text.strip()
    assert out.prompt == "The capital of France is"
    assert out.prompt_token_ids == llm.tokenizer.encode("The capital of France is", add_special_tokens=True)
    assert out.text == llm.tokenizer.decode(out.token_ids)
    assert out.metrics.time_to_first_token is not None and out.metrics.time_to_first_token > 0


def test_greedy_is_batch_invariant(llm: LLM) -> None:
    alone = llm.generate(PROMPTS[4], GREEDY)
    batched = llm.generate(PROMPTS, GREEDY)
    assert batched[4].token_ids == alone[0].token_ids


def test_seeded_sampling_is_batch_invariant_and_reproducible(llm: LLM) -> None:
    target = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], target)[0].token_ids
    assert len(alone) == 16
    others = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=8 + i) for i in range(7)]
    params = [*others[:3], target, *others[3:]]
    prompts = [*PROMPTS[:1], *PROMPTS[2:4], PROMPTS[1], *PROMPTS[4:]]
    batched = llm.generate(prompts, params)
    assert batched[3].token_ids == alone
    assert llm.generate(PROMPTS[1], target)[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.8, top_p=0.95, seed=8, max_tokens=16, ignore_eos=True)
    assert llm.generate(PROMPTS[1], other_seed)[0].token_ids != alone


def test_prefix_cache_hit_matches_cold_run(llm: LLM, make_llm: Callable[..., LLM]) -> None:
    first = llm.generate(LONG_PREFIX + "Question: how many towns?", GREEDY)[0]
    second_prompt = LONG_PREFIX + "Question: what does each town have?"
    warm = llm.generate(second_prompt, GREEDY)[0]
    assert warm.num_cached_tokens >= 32 and warm.num_cached_tokens % 16 == 0
    cold_llm = make_llm(enable_prefix_caching=False)
    cold = cold_llm.generate(second_prompt, GREEDY)[0]
    assert cold.num_cached_tokens == 0
    assert warm.token_ids == cold.token_ids
    assert first.num_cached_tokens == 0 or first.num_cached_tokens < warm.num_cached_tokens


def test_preemption_under_tiny_pool_matches_big_pool(llm: LLM, make_llm: Callable[..., LLM]) -> None:
    prompts = PROMPTS[4:8]
    # EOS ignored so every request really grows to 24 tokens: 4 x ~3 blocks cannot fit in 8 blocks.
    params = [
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=5, max_tokens=24, ignore_eos=True),
    ]
    reference = llm.generate(prompts, params)
    tiny = make_llm(num_kv_blocks=8, enable_prefix_caching=False)
    squeezed = tiny.generate(prompts, params)
    assert tiny.engine.scheduler.num_preemptions > 0
    assert tokens(squeezed) == tokens(reference)
    assert any(o.metrics.num_preemptions > 0 for o in squeezed)
    assert tiny.engine.block_manager.num_free_blocks == 8


def test_chunked_prefill_matches_unchunked(llm: LLM, make_llm: Callable[..., LLM]) -> None:
    prompts = [LONG_PREFIX + "Summarise the background.", PROMPTS[7]]
    reference = llm.generate(prompts, GREEDY)
    chunked = make_llm(max_num_batched_tokens=16, enable_prefix_caching=False)
    outputs = chunked.generate(prompts, GREEDY)
    assert len(outputs[0].prompt_token_ids) > 3 * 16  # the long prompt really took several steps
    assert tokens(outputs) == tokens(reference)


def test_stop_string_truncates_text(llm: LLM) -> None:
    free = llm.generate(PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=16))[0]
    words = free.text.split()
    assert len(words) >= 3
    stop = words[2]
    out = llm.generate(PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=16, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert stop not in out.text and free.text.startswith(out.text)
    assert out.text == free.text[: free.text.index(stop)]


def test_stop_string_spanning_tokens(llm: LLM) -> None:
    free = llm.generate(PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=16))[0]
    # A stop string that starts inside one token's text and ends inside a later token's.
    pieces = [llm.tokenizer.decode([t]) for t in free.token_ids]
    first_end = len(pieces[0]) + len(pieces[1])
    stop = free.text[first_end - 2 : first_end + 3]
    assert len(stop) == 5
    out = llm.generate(PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=16, stop=stop))[0]
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(stop)]


def test_stop_token_id_ends_request(llm: LLM) -> None:
    free = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8))[0]
    stop_token = free.token_ids[3]
    out = llm.generate(
        PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_token])
    )[0]
    first = free.token_ids.index(stop_token)
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: first + 1]


def test_chat_applies_template_and_stops_at_eos(llm: LLM) -> None:
    (out,) = llm.chat(
        [{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0.0, max_tokens=24)
    )
    assert out.prompt is not None and "Say hi." in out.prompt
    assert out.finish_reason in ("stop", "length") and out.text
    if out.finish_reason == "stop":
        assert out.token_ids[-1] in llm.engine.eos_token_ids
    both = llm.chat(
        [[{"role": "user", "content": "Say hi."}], [{"role": "user", "content": "Name a color."}]],
        SamplingParams(temperature=0.0, max_tokens=24),
    )
    assert both[0].token_ids == out.token_ids and len(both) == 2


def test_ignore_eos_runs_to_max_tokens(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    (out,) = llm.chat([{"role": "user", "content": "Say hi."}], params)
    assert out.finish_reason == "length" and len(out.token_ids) == 24


def test_token_id_prompt_and_logprobs(llm: LLM) -> None:
    ids = llm.tokenizer.encode("The quick brown fox", add_special_tokens=True)
    (out,) = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))
    assert out.prompt is None and out.prompt_token_ids == ids
    assert out.outputs[0].logprobs is not None and len(out.outputs[0].logprobs) == 4
    for token, entry in zip(out.token_ids, out.outputs[0].logprobs):
        assert token in entry and len(entry) >= 3
        # Greedy: the chosen token is the most likely one.
        assert entry[token] == max(entry.values()) and entry[token] <= 0.0


def test_bad_input_raises_typed_errors(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("")
    assert info.value.field == "prompt"
    with pytest.raises(InvalidRequestError):
        llm.generate([[]])
    with pytest.raises(InvalidRequestError, match="token"):
        llm.generate([[1, 2, 10**9]])
    with pytest.raises(PromptTooLongError):
        llm.generate([[1] * llm.engine.max_model_len])
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("hi", SamplingParams(max_tokens=0))
    assert info.value.field == "max_tokens"
    with pytest.raises(InvalidRequestError):
        llm.generate(["a", "b"], [GREEDY])
    assert not llm.engine.has_unfinished_requests()


def test_unknown_engine_option_is_config_error() -> None:
    with pytest.raises(ConfigError, match="max_num_seq"):
        LLM(max_num_seq=4)


def test_bad_prompt_in_batch_leaves_nothing_running(llm: LLM) -> None:
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine prompt", ""], GREEDY)
    assert not llm.engine.has_unfinished_requests() and not llm.engine.requests


def test_abort_ends_request_and_frees_blocks(llm: LLM) -> None:
    engine = llm.engine
    free_before = engine.block_manager.num_free_blocks
    engine.add_request("keep", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6))
    # ignore_eos: the request must still be running when it is aborted, whatever its first token
    engine.add_request("drop", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.abort("drop")
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["drop"].finish_reason == "abort" and len(finals["drop"].token_ids) == 1
    assert finals["keep"].finish_reason == "length" and len(finals["keep"].token_ids) == 6
    assert engine.block_manager.num_free_blocks == free_before


def test_failing_request_ends_alone(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.engine
    real = engine.postprocessor._detokenize

    def flaky(seq: Any) -> None:
        if seq.request_id == "bad":
            raise RuntimeError("boom")
        real(seq)

    monkeypatch.setattr(engine.postprocessor, "_detokenize", flaky)
    engine.add_request("bad", PROMPTS[0], GREEDY)
    engine.add_request("good", PROMPTS[0], GREEDY)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["bad"].finish_reason == "error" and "boom" in (finals["bad"].outputs[0].error or "")
    assert finals["good"].finish_reason == "length" and len(finals["good"].token_ids) == 12


def test_failing_forward_is_isolated_to_its_request(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = llm.engine
    real_run = engine.runner.run

    def run(batch: list[Any], *args: Any) -> Any:
        if any(item.seq.request_id == "poison" for item in batch):
            raise RuntimeError("kernel failure")
        return real_run(batch, *args)

    monkeypatch.setattr(engine.runner, "run", run)
    reference = llm.generate(PROMPTS[2], GREEDY)[0]
    engine.add_request("poison", PROMPTS[0], GREEDY)
    engine.add_request("healthy", PROMPTS[2], GREEDY)
    finals: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert finals["poison"].finish_reason == "error" and "kernel failure" in (
        finals["poison"].outputs[0].error or ""
    )
    assert finals["healthy"].token_ids == reference.token_ids
