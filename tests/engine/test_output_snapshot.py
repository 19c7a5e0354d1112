"""``RequestOutput.from_sequence`` builds its frozen snapshots without the dataclass constructors
(engine/output.py ``_frozen``): they must equal what the constructors build, field for field, and
stay frozen and independent of later steps."""

from __future__ import annotations

import dataclasses

import pytest

from agent_infer.engine.output import CompletionOutput, DraftStats, RequestMetrics, RequestOutput
from agent_infer.engine.sequence import FinishReason, Sequence
from agent_infer.sampling_params import SamplingParams


def _by_constructors(seq: Sequence) -> RequestOutput:
    m = seq.metrics
    return RequestOutput(
        request_id=seq.request_id,
        prompt=seq.prompt,
        prompt_token_ids=seq.prompt_token_ids,
        outputs=[
            CompletionOutput(
                text=seq.output_text,
                token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason.value if seq.finish_reason is not None else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                error=seq.error,
            )
        ],
        num_cached_tokens=seq.num_cached_tokens,
        metrics=RequestMetrics(
            arrival_time=m.arrival_time,
            first_scheduled_time=m.first_scheduled_time,
            first_token_time=m.first_token_time,
            finished_time=m.finished_time,
            num_preemptions=m.num_preemptions,
            num_forced_tokens=seq.num_forced_tokens,
            num_closing_tokens=seq.num_closing_tokens,
            num_draft_tokens=seq.spec.num_drafted,
            num_accepted_draft_tokens=seq.spec.num_accepted,
            draft_sources={k: DraftStats(*v) for k, v in seq.spec.by_source.items()},
        ),
    )


@pytest.mark.parametrize("finished", [False, True])
def test_snapshot_equals_the_constructors(finished: bool) -> None:
    seq = Sequence("r", [5, 6, 7], SamplingParams(logprobs=1), prompt="abc")
    seq.token_ids += [8, 9]
    seq.output_text = "xy"
    seq.logprobs = [{8: -0.5}, {9: -1.0}]
    seq.num_forced_tokens, seq.num_closing_tokens, seq.num_cached_tokens = 1, 2, 3
    seq.metrics.first_token_time = seq.metrics.arrival_time + 0.25
    seq.spec.by_source["ngram"] = [4, 3, 2]
    if finished:
        seq.finish(FinishReason.ERROR, "boom")
    out = RequestOutput.from_sequence(seq)
    want = _by_constructors(seq)
    assert out == want
    for got, ref in ((out, want), (out.outputs[0], want.outputs[0]), (out.metrics, want.metrics)):
        assert type(got) is type(ref)
        assert vars(got) == vars(ref)  # every field, nothing more
        assert [f.name for f in dataclasses.fields(got)] == list(vars(got))
    assert out.metrics.draft_sources == {"ngram": DraftStats(4, 3, 2)}
    assert out.finished is finished
    with pytest.raises(dataclasses.FrozenInstanceError):
        out.outputs[0].text = "changed"  # type: ignore[misc]
    seq.token_ids.append(10)
    seq.logprobs.append({10: -2.0})
    assert out.token_ids == [8, 9] and len(out.outputs[0].logprobs or []) == 2
