"""The Postprocessor on the real default model: a step's tokens through grammar, stop checks and text.

Drafts here are what greedy decoding will produce (taken from a plain run), so the real forward
pass accepts them whole and the step hands the postprocessor several tokens at once; the edge
cases are the ones that land inside such a step: a stop string completed mid-draft, ``max_tokens``
reached mid-draft, the grammar ending mid-draft.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agent_infer import SamplingParams
from agent_infer.engine.sequence import FinishReason, Sequence
from agent_infer.engine.step_result import StepResult
from agent_infer.structured import StructuredOutput

PROMPT = [{"role": "user", "content": "Repeat exactly: the quick brown fox jumps over the lazy dog."}]
WORD = StructuredOutput.regex("[a-z]+")


@pytest.fixture(scope="module")
def plain(make_llm: Callable[..., Any]) -> Any:
    return make_llm(enable_prefix_caching=False, speculative_tokens=0, boundary_drafts=False)


@pytest.fixture(scope="module")
def spec(make_llm: Callable[..., Any]) -> Any:
    return make_llm(enable_prefix_caching=False, speculative_tokens=4)


@pytest.fixture(autouse=True)
def _no_request_left(spec: Any) -> Iterator[None]:
    yield
    engine = spec.engine
    for request_id in list(engine.requests):
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _prompt_ids(llm: Any) -> list[int]:
    tok = llm.engine.tokenizer
    return tok.encode(tok.apply_chat_template(PROMPT, add_generation_prompt=True), add_special_tokens=False)


def _reference(plain: Any, params: SamplingParams) -> list[int]:
    """What greedy decoding produces without drafts."""
    return plain.generate([_prompt_ids(plain)], params)[0].token_ids


def _first_token(spec: Any, params: SamplingParams) -> Sequence:
    """Admit a request and step until it has sampled its first token."""
    engine = spec.engine
    engine.add_request("r", _prompt_ids(spec), params)
    seq: Sequence = engine.requests["r"]
    while seq.num_output_tokens == 0:
        engine.step()
    return seq


def _step_with_draft(spec: Any, seq: Sequence, draft: list[int]) -> list[Any]:
    """One engine step in which ``seq`` feeds ``draft`` after its pending token."""
    seq.spec.draft = list(draft)
    seq.spec.forced_after = False
    fed: list[tuple[int, ...]] = []
    runner = spec.engine.runner
    run = runner.run
    runner.run = lambda batch, *a: fed.append(batch[0].draft) or run(batch, *a)
    try:
        outputs = spec.engine.step()
    finally:
        runner.run = run
    assert fed == [tuple(draft)]
    return outputs


def test_an_accepted_draft_counts_as_computed(plain: Any, spec: Any) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12)
    ref = _reference(plain, params)
    seq = _first_token(spec, params)
    assert seq.output_token_ids == ref[:1]
    _step_with_draft(spec, seq, ref[1:4])
    # Three draft tokens accepted and one token of the model's own: only that one is pending.
    assert seq.output_token_ids == ref[:5]
    assert seq.num_computed_tokens == seq.num_tokens - 1
    assert (seq.spec.num_drafted, seq.spec.num_accepted) == (3, 3)


def test_a_stop_string_completed_inside_a_draft_cuts_the_text_there(plain: Any, spec: Any) -> None:
    ref = _reference(plain, SamplingParams(temperature=0.0, max_tokens=12))
    tok = spec.engine.tokenizer
    # A stop string spanning the second and third draft tokens: the rest of the step is dropped.
    head, tail = tok.decode(ref[2:3]), tok.decode(ref[3:4])
    stop = head[len(head) // 2 :] + tail[: max(1, len(tail) // 2)]
    assert stop not in tok.decode(ref[:3]), "the stop string occurs earlier: the test checks nothing"
    params = SamplingParams(temperature=0.0, max_tokens=12, stop=[stop])
    seq = _first_token(spec, params)
    (out,) = _step_with_draft(spec, seq, ref[1:5])
    assert out.finish_reason == "stop"
    assert out.token_ids == ref[:4]  # the token completing the stop string is the last kept
    full = tok.decode(ref[:4])
    assert out.text == full[: full.index(stop)]
    assert out.text == plain.generate([_prompt_ids(plain)], params)[0].text


@pytest.mark.parametrize("draft_len", [2, 5])
def test_max_tokens_reached_inside_a_draft_ends_the_request_there(
    plain: Any, spec: Any, draft_len: int
) -> None:
    ref = _reference(plain, SamplingParams(temperature=0.0, max_tokens=12))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    seq = _first_token(spec, params)
    # A draft of 2 fills max_tokens with the model's own token after it; one of 5 overshoots.
    (out,) = _step_with_draft(spec, seq, ref[1 : 1 + draft_len])
    assert out.finish_reason == "length"
    assert out.token_ids == ref[:4]
    assert out.text == spec.engine.tokenizer.decode(ref[:4])


def test_the_grammar_ending_inside_a_draft_ends_the_request_there(plain: Any, spec: Any) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16, structured=WORD)
    ref = _reference(plain, params)
    eos = spec.engine.eos_token_ids
    assert len(ref) >= 3 and ref[-1] in eos, "the word does not end within the test's budget"
    seq = _first_token(spec, params)
    assert seq.output_token_ids == ref[:1]
    # The draft runs up to the EOS that ends the grammar; the step's bonus row is never accepted.
    (out,) = _step_with_draft(spec, seq, ref[1:])
    assert out.finish_reason == "stop"
    assert out.token_ids == ref and out.text == plain.generate([_prompt_ids(plain)], params)[0].text
    assert seq.matcher is not None and seq.matcher.is_terminated()


def test_a_request_that_failed_while_running_ends_alone(spec: Any) -> None:
    engine = spec.engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    seq = _first_token(spec, params)
    engine.add_request("other", _prompt_ids(spec), params)
    other = engine.requests["other"]
    plan = engine.scheduler.schedule()
    items = {item.seq: item for item in plan.scheduled}
    assert set(items) == {seq, other}
    assert not items[other].samples, "the new prompt was not chunked: the test checks less"
    result = StepResult({}, {seq: RuntimeError("kernel failure")})
    outputs = engine.postprocessor.process(plan, result)
    engine.requests.pop("r")  # what step() does with a finished request
    assert [out.request_id for out in outputs] == ["r"]  # a prefill chunk reports nothing yet
    assert outputs[0].finish_reason == "error"
    assert outputs[0].outputs[0].error == "RuntimeError: kernel failure"
    assert seq.finish_reason is FinishReason.ERROR and seq.block_table == []
    assert seq not in engine.scheduler.running
    assert other.num_computed_tokens == items[other].num_new_tokens  # its chunk was accounted
