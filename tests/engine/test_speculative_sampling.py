"""Sampled requests keep the target distribution under drafts: chi-square tests at fixed seeds, on
the verification rule alone (where a biased rule is shown to fail the same test) and through the
engine on a tiny MTP model."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from deepseek_support import BYTE_VOCAB, save_tiny_mtp, write_byte_tokenizer

from agent_infer import LLM, SamplingParams
from agent_infer.engine.drafts.vocab import RANKING_FILE
from agent_infer.engine.speculator import verify_rows

#: Chi-square critical values at p = 0.001 by degrees of freedom (a fixed seed makes each run
#: deterministic; the level bounds how unlucky a correct rule's seed could have been).
KV = 8 << 20  # the tiny model needs little cache; the default would allocate 512 MiB per engine
CRITICAL_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88}


def _chi_square(counts: Counter[int], probs: torch.Tensor, n: int) -> tuple[float, int]:
    stat = sum((counts.get(t, 0) - n * float(p)) ** 2 / (n * float(p)) for t, p in enumerate(probs))
    return stat, len(probs) - 1


def _biased_first_token(rows: torch.Tensor, draft: int, gen: torch.Generator) -> int:
    """A wrong rule: keep the draft with its probability, else draw again from the full row (the
    draft included), which over-weights the drafted token."""
    probs = torch.softmax(rows[0], dim=0)
    if float(torch.rand((), generator=gen)) < float(probs[draft]):
        return draft
    return int(torch.multinomial(probs, 1, generator=gen))


@pytest.mark.parametrize("draft", [[1], [4, 2]], ids=["likely-draft", "unlikely-draft-of-2"])
def test_first_token_distribution_matches_the_target(draft: list[int]) -> None:
    logits = torch.tensor([[0.2, 1.4, -0.5, 0.9, 0.0, -1.2], [1.0, 0.0, 0.5, -0.5, 0.3, 0.1], [0.0] * 6])
    rows = logits[: 1 + len(draft)]
    probs = torch.softmax(rows[0], dim=0)
    params = SamplingParams(temperature=1.0)
    n = 20_000
    gen = torch.Generator().manual_seed(1234)
    ours = Counter(verify_rows(rows, draft, params, gen)[0][0] for _ in range(n))
    stat, df = _chi_square(ours, probs, n)
    assert stat < CRITICAL_001[df], (stat, ours)
    gen = torch.Generator().manual_seed(1234)
    biased = Counter(_biased_first_token(rows, draft[0], gen) for _ in range(n))
    stat, df = _chi_square(biased, probs, n)
    assert stat > CRITICAL_001[df]  # the same test catches an acceptance rule that favours the draft


@pytest.mark.slow
@pytest.mark.parametrize("draft_vocab", [0, 48], ids=["full-head", "sliced-head"])
def test_engine_sampled_tokens_keep_their_distribution_with_mtp_drafts(
    tmp_path: Path, draft_vocab: int
) -> None:
    """The second output token (the first one a draft can cover) of many seeded requests, with MTP
    drafts always fed (confidence 0) against other seeds without drafts: a two-sample chi-square.
    With a sliced head the draft chooses among 48 ids (the prompt's bytes ranked first)."""
    save_tiny_mtp(tmp_path, predictable=True, vocab_size=BYTE_VOCAB, eos_token_id=256)
    write_byte_tokenizer(tmp_path)
    n = 400
    prompt = "The quick brown"
    ranked = list(dict.fromkeys(prompt.encode())) + list(range(256))
    (tmp_path / RANKING_FILE).write_text(json.dumps({"token_ids": list(dict.fromkeys(ranked))}))
    counts = []
    for source, seeds in (("mtp", range(n)), ("off", range(n, 2 * n))):
        # Few at a time: in a big batch the scheduler drops drafts that do not pay off.
        llm = LLM(
            model=str(tmp_path),
            speculative_source=source,
            speculative_confidence=0.0,
            speculative_draft_vocab=draft_vocab,
            max_num_seqs=8,
            kv_cache_memory_bytes=KV,
        )
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=3, ignore_eos=True) for s in seeds]
        outs = llm.generate([prompt] * n, params)
        if source == "mtp":
            assert sum(o.metrics.num_draft_tokens for o in outs) >= n // 2
        counts.append(Counter(o.outputs[0].token_ids[1] for o in outs))
    a, b = counts
    tokens = sorted(set(a) | set(b), key=lambda t: -(a[t] + b[t]))
    # Tokens too rare for the approximation share one bin.
    bins = [[t] for t in tokens if a[t] + b[t] >= 10]
    rest = [t for t in tokens if a[t] + b[t] < 10]
    if rest:
        bins.append(rest)
    assert len(bins) >= 3  # the test has something to compare
    stat = 0.0
    for group in bins:
        x, y = sum(a[t] for t in group), sum(b[t] for t in group)
        expected = (x + y) / 2
        stat += (x - expected) ** 2 / expected + (y - expected) ** 2 / expected
    df = len(bins) - 1
    assert stat < CRITICAL_001.get(df, 27.88 + 2.0 * (df - 9)), (stat, a, b)
