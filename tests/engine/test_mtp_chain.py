"""MTP drafts from several modules (module k proposes the (k+1)-th draft token, then the last one is
chained) and from a draft vocabulary smaller than the model's: greedy outputs equal plain decoding
(alone, batched, constrained), the deeper modules' caches equal a pass over the whole text, and the
``auto`` policy still drafts where it pays."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from deepseek_support import BYTE_VOCAB, save_tiny_mtp, write_byte_tokenizer

from agent_infer import LLM, SamplingParams
from agent_infer.engine.drafts.vocab import RANKING_FILE

pytest.importorskip("transformers")

KV = 8 << 20
PROMPTS = ["Hello there, how are you", "The quick brown fox jumps", "abc abc abc abc", "1, 2, 3, 4, 5"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
#: Draft vocabulary size for the sliced-head engines: the letters and spaces the prompts use, not
#: the JSON punctuation, so constrained drafts also meet positions where it allows nothing.
SMALL_VOCAB = 40


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny V3 with two predictable MTP modules and a draft-vocabulary ranking of the prompts' bytes."""
    path = tmp_path_factory.mktemp("tiny_v3_mtp2")
    save_tiny_mtp(path, predictable=True, vocab_size=BYTE_VOCAB, eos_token_id=256, depth=2)
    write_byte_tokenizer(path)
    counts = Counter(b for p in PROMPTS for b in p.encode())
    ranked = [t for t, _ in counts.most_common()] + [t for t in range(256) if t not in counts]
    (path / RANKING_FILE).write_text(json.dumps({"token_ids": ranked}))
    return path


@pytest.fixture(scope="module")
def engines(folder: Path) -> dict[str, LLM]:
    def make(**kw: Any) -> LLM:
        return LLM(model=str(folder), kv_cache_memory_bytes=KV, **kw)

    return {
        "off": make(speculative_source="off"),
        "mtp": make(speculative_source="mtp", speculative_confidence=0.0, speculative_draft_vocab=0),
        "small": make(
            speculative_source="mtp", speculative_confidence=0.0, speculative_draft_vocab=SMALL_VOCAB
        ),
        "auto": make(speculative_source="auto", speculative_draft_vocab=SMALL_VOCAB),
    }


def _tokens(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_both_modules_load_and_the_vocabulary_is_sliced(engines: dict[str, LLM]) -> None:
    small = engines["small"].engine.speculator
    full = engines["mtp"].engine.speculator
    assert small is not None and small.mtp is not None and full is not None and full.mtp is not None
    assert small.mtp.depth == 2 and len(small.mtp.pools) == 2
    assert small.mtp.vocab.size == SMALL_VOCAB and small.mtp.vocab.source == "file"
    assert all(int(w.shape[0]) == SMALL_VOCAB for _, w in small.mtp.heads)
    assert full.mtp.vocab.ids is None and int(full.mtp.heads[0][1].shape[0]) == BYTE_VOCAB


@pytest.mark.parametrize("source", ["mtp", "small", "auto"])
def test_greedy_equals_plain_decoding_alone_and_batched(engines: dict[str, LLM], source: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    plain = _tokens(engines["off"].generate(PROMPTS, params))
    alone = [engines[source].generate([p], params)[0] for p in PROMPTS]
    outs = engines[source].generate(PROMPTS, params)
    assert _tokens(alone) == plain and _tokens(outs) == plain
    # ``auto`` drafts where drafting pays by the costs it measures on this machine: alone it does;
    # among four requests of this tiny model a draft's own overhead may outweigh what it keeps.
    counted = outs if source != "auto" else outs + alone
    accepted = sum(o.metrics.num_accepted_draft_tokens for o in counted)
    assert 0 < accepted <= sum(o.metrics.num_draft_tokens for o in counted)


def test_the_second_module_drafts_the_second_token(engines: dict[str, LLM]) -> None:
    """Drafts reach past the first token (module 1's proposal), and such tokens are accepted."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    outs = engines["mtp"].generate(PROMPTS, params)
    stats = [o.metrics.draft_sources["mtp"] for o in outs]
    drafted = sum(s.drafted for s in stats)
    verifications = sum(s.verifications for s in stats)
    assert drafted > 1.5 * verifications  # most drafts are longer than one token
    assert sum(s.accepted for s in stats) > verifications  # and keep more than one token on average


@pytest.mark.parametrize("source", ["mtp", "small"])
def test_structured_outputs(engines: dict[str, LLM], source: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=50, structured=SCHEMA)
    plain = engines["off"].generate(PROMPTS, params)
    outs = engines[source].generate(PROMPTS, params)
    assert _tokens(outs) == _tokens(plain)
    for out in outs:
        if out.outputs[0].finish_reason == "stop":
            json.loads(out.outputs[0].text)


def test_seeded_sampling_is_reproducible(engines: dict[str, LLM]) -> None:
    for params in (SamplingParams(temperature=0.8, seed=s, max_tokens=30, ignore_eos=True) for s in (1, 2)):
        want = _tokens(engines["off"].generate(PROMPTS[:2], params))
        assert _tokens(engines["small"].generate(PROMPTS[:2], params)) == want


def test_module_caches_equal_a_pass_over_the_whole_text(engines: dict[str, LLM]) -> None:
    """After a request, each module's cache entries of every position it ran equal running the
    modules in sequence over the whole text (module 1 reads module 0's outputs, two tokens ahead)."""
    from agent_infer.model.families.deepseek_v3 import DeepseekV3ForCausalLM
    from agent_infer.model.kv_cache import KVCache
    from agent_infer.model.layers.attention import AttentionMetadata, PagedAttention

    llm = engines["mtp"]
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("probe", " ".join(PROMPTS), params)
    seq = engine.requests["probe"]
    table: list[int] = []
    newest: list[int] = [-1, -1]
    while engine.has_unfinished_requests():
        table = list(seq.block_table)
        for d, q in enumerate(seq.spec.mtp):
            if q.output is not None:
                newest[d] = q.newest
        engine.step()
    tokens = seq.token_ids
    model = engine.runner.model
    drafter = engine.speculator.mtp  # type: ignore[union-attr]
    assert isinstance(model, DeepseekV3ForCausalLM) and drafter is not None
    assert newest[0] > 20 and newest[1] > 20
    n, bs = newest[0] + 1, engine.config.block_size
    blocks = list(range((n + 1 + bs - 1) // bs))
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(n + 1)])
    cache = KVCache.allocate(model.config, len(blocks), bs, model.device, model.dtype)
    meta = AttentionMetadata([0, n + 1], [n + 1], [blocks], slots, bs)
    layers = model.mtp_layers()
    with torch.no_grad():
        hidden = model(torch.tensor(tokens[: n + 1]), torch.arange(n + 1), meta, cache)
        inputs = hidden[:n]
        for d in range(2):
            m = newest[d] + 1
            pool = torch.zeros(len(blocks) * bs, int(drafter.pools[d].shape[1]))
            meta = AttentionMetadata([0, m], [m], [blocks], slots[:m], bs)
            plan = PagedAttention().plan(meta, m, pool.shape[0], model.device)
            ids = torch.tensor(tokens[d + 1 : d + 1 + m])
            inputs = layers[d].forward(
                inputs[:m], ids, model.embed, model.rotary.at(torch.arange(m)), pool, plan
            )
            got = drafter.pools[d][torch.tensor([table[p // bs] * bs + p % bs for p in range(m)])]
            assert (got - pool[:m]).abs().max().item() <= 1e-4, d
