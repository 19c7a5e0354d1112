"""DeepSeek V4 against transformers on tiny random checkpoints: logits through the compressed paged
cache (prefill, decode, chunks), batch invariance, prefix-cache hits, and a run through the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepseek_support import assert_alone_equals_mixed_batch, load_ours, save_tiny_v4, write_tokenizer

from agent_infer.errors import EngineError
from agent_infer.model.families.base import CausalLM
from agent_infer.model.kv_cache import KVCache
from agent_infer.model.layers import compressed_attention
from agent_infer.model.layers.attention import AttentionMetadata
from agent_infer.model.runner import SequenceRunner

transformers = pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")

#: Max abs logit difference allowed against transformers (float32; about 5e-6 is reached).
TOL = 1e-4
PROMPT_LEN, DECODE_STEPS = 40, 16


def _prompt(seed: int = 0, length: int = PROMPT_LEN) -> list[int]:
    return torch.randint(2, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model: CausalLM, prompt: list[int], block_size: int) -> tuple[list[int], torch.Tensor]:
    """Prefill then greedy decode through the paged cache: the tokens and every step's logits."""
    runner = SequenceRunner(model, num_blocks=64 // block_size * 4, block_size=block_size)
    logits = [runner.step([(0, prompt)])[0]]
    tokens = list(prompt)
    for _ in range(DECODE_STEPS):
        tokens.append(int(logits[-1].argmax()))
        logits.append(runner.step([(0, [tokens[-1]])])[0])
    return tokens, torch.stack(logits)


@pytest.fixture(scope="module", params=["torch", "packed"])
def tiny(
    tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> tuple[torch.nn.Module, CausalLM]:
    """The model on the torch kernels, and on the packed-float ones ``load_model`` picks on the CPU
    (native decode rows, hyper-connections and experts)."""
    d = tmp_path_factory.mktemp("v4")
    return save_tiny_v4(d), load_ours(d, packed=request.param == "packed")


@pytest.mark.parametrize(("block_size", "yarn"), [(16, False), (4, True)], ids=["bs16-plain", "bs4-yarn"])
def test_logits_match_transformers_prefill_and_decode(block_size: int, yarn: bool, tmp_path: Path) -> None:
    """Block 16 holds several entries per block; block 4 is smaller than the heavy layers' rate 8."""
    hf = save_tiny_v4(tmp_path, yarn=yarn)
    ours = load_ours(tmp_path)
    tokens, got = _run(ours, _prompt(), block_size)
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0, PROMPT_LEN - 1 :]
    assert want.abs().max().item() > 1.0  # unit-scale random weights: the comparison is not vacuous
    assert (got - want).abs().max().item() <= TOL
    assert want[:-1].argmax(-1).tolist() == tokens[PROMPT_LEN:]


def test_chunked_prefill_matches_transformers(tiny: tuple[torch.nn.Module, CausalLM]) -> None:
    """Chunks ending inside windows: later chunks close windows whose first tokens an earlier one cached."""
    hf, model = tiny
    prompt = _prompt(4)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    runner = SequenceRunner(model, num_blocks=16, block_size=8)
    start = 0
    for end in (5, 13, 14, 22, 31, 40):
        got = runner.step([(0, prompt[start:end])])[0]
        assert (got - want[end - 1]).abs().max().item() <= TOL
        start = end


@pytest.mark.parametrize("query_block", [256, 7])
def test_every_prefill_row_matches_transformers(
    tiny: tuple[torch.nn.Module, CausalLM], query_block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All 40 rows of one prefill chunk, attending whole or in pieces of 7 queries."""
    monkeypatch.setattr(compressed_attention, "QUERY_BLOCK", query_block)
    hf, model = tiny
    prompt = _prompt(5)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    cache = KVCache.allocate(model.config, 4, 16, model.device, model.dtype)
    table = [3, 0, 2]
    slots = [table[p // 16] * 16 + p % 16 for p in range(PROMPT_LEN)]
    meta = AttentionMetadata([0, PROMPT_LEN], [PROMPT_LEN], [table], torch.tensor(slots), 16)
    hidden = model(torch.tensor(prompt), torch.arange(PROMPT_LEN), meta, cache, keep_rows=range(PROMPT_LEN))
    assert (model.compute_logits(hidden) - want).abs().max().item() <= TOL


def test_batch_invariance_with_mixed_requests(tiny: tuple[torch.nn.Module, CausalLM]) -> None:
    """A request's logits are bit-identical alone and in a batch of 8 (prefills, chunks and decodes)."""
    _, model = tiny
    assert_alone_equals_mixed_batch(model)


def _step(model: CausalLM, cache: KVCache, table: list[int], start: int, tokens: list[int]) -> torch.Tensor:
    bs = cache.block_size
    end = start + len(tokens)
    slots = [table[p // bs] * bs + p % bs for p in range(start, end)]
    meta = AttentionMetadata([0, len(tokens)], [end], [table], torch.tensor(slots), bs)
    hidden = model(torch.tensor(tokens), torch.arange(start, end), meta, cache, keep_rows=[len(tokens) - 1])
    return model.compute_logits(hidden)[0]


@pytest.mark.parametrize(("block_size", "shared_len"), [(16, 32), (4, 28)], ids=["bs16", "bs4-open-window"])
def test_prefix_cache_hit_gives_the_cold_logits(
    tiny: tuple[torch.nn.Module, CausalLM], block_size: int, shared_len: int
) -> None:
    """A second prompt reusing the first one's full blocks (window entries, compressor states and the
    compressed entries they complete) gives the logits of a cold run of it. With 4-token blocks the
    hit ends inside a heavy layer's 8-token window, which the second prompt then closes."""
    _, model = tiny
    shared = _prompt(11, shared_len)
    first, second = shared + _prompt(12, 9), shared + _prompt(13, 13)
    bs, hit_blocks = block_size, shared_len // block_size
    blocks = -(-len(second) // bs)
    pool = list(range(3 * blocks))[::-1]  # not 0, 1, 2...: exercises the paging
    table_first = pool[: -(-len(first) // bs)]
    table_second = table_first[:hit_blocks] + pool[len(table_first) : len(table_first) + blocks - hit_blocks]
    cache = KVCache.allocate(model.config, 3 * blocks, bs, model.device, model.dtype)
    _step(model, cache, table_first, 0, first)
    hit = _step(model, cache, table_second, shared_len, second[shared_len:])
    cold_cache = KVCache.allocate(model.config, 3 * blocks, bs, model.device, model.dtype)
    cold = _step(model, cold_cache, list(range(blocks)), 0, second)
    assert (hit - cold).abs().max().item() <= 1e-5  # about 2e-6 is reached: chunk shapes differ
    assert int(hit.argmax()) == int(cold.argmax())
    unshared = KVCache.allocate(model.config, 3 * blocks, bs, model.device, model.dtype)
    assert (_step(model, unshared, table_second, shared_len, second[shared_len:]) - cold).abs().max() > 0.1


def test_rejected_draft_leaves_no_trace(tiny: tuple[torch.nn.Module, CausalLM]) -> None:
    """Draft tokens that close windows and are then rejected: the true tokens fed at the same
    positions recompute those windows, and the logits equal a run that never saw the draft."""
    _, model = tiny
    prompt, true_tokens, draft = _prompt(21, 37), _prompt(22, 4), _prompt(23, 11)
    table = [5, 1, 3, 0]
    clean = KVCache.allocate(model.config, 6, 16, model.device, model.dtype)
    _step(model, clean, table, 0, prompt)
    want = _step(model, clean, table, 37, true_tokens)
    cache = KVCache.allocate(model.config, 6, 16, model.device, model.dtype)
    _step(model, cache, table, 0, prompt)
    _step(model, cache, table, 37, draft)  # positions 37..47 close windows of both rates
    got = _step(model, cache, table, 37, true_tokens)
    assert torch.equal(got, want)


def test_misuse_raises_engine_errors(tiny: tuple[torch.nn.Module, CausalLM]) -> None:
    _, model = tiny
    kv_layout = KVCache(k=[], v=[], num_blocks=4, block_size=16)
    meta = AttentionMetadata([0, 1], [1], [[0]], torch.tensor([0]), 16)
    with pytest.raises(
        EngineError, match=r"deepseek_v4 model needs a KV cache in the compressed layout .* got the kv layout"
    ):
        model(torch.tensor([5]), torch.tensor([0]), meta, kv_layout)
    cache = KVCache.allocate(model.config, 4, 16, model.device, model.dtype)
    with pytest.raises(EngineError, match="beyond the model's 256-token context"):
        model(torch.tensor([5]), torch.tensor([256]), meta, cache)


def test_engine_generates_schema_valid_json_and_reports_kv_bytes(tmp_path: Path) -> None:
    from agent_infer import LLM, SamplingParams

    save_tiny_v4(tmp_path, vocab_size=49152)  # covers the SmolLM2 tokenizer's ids
    assert write_tokenizer(tmp_path) <= 49152
    d, di = 32, 16
    # per token: every layer's window entry; heavy layers (rate 8) 2*d of state plus d per 8 tokens;
    # sparse layers (rate 4) 4*(d+di) of state plus (d+di) per 4 tokens; float32
    per_token = (5 * d + 2 * (2 * d + d // 8) + 2 * (4 * (d + di) + (d + di) // 4)) * 4
    llm = LLM(model=str(tmp_path), kv_cache_memory_bytes=per_token * 16 * 40 + 100, block_size=16)
    runner = llm.engine.runner
    assert runner.kv_cache.layout == "compressed" and runner.kv_bytes_per_token == per_token
    assert runner.num_blocks == 40
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    params = SamplingParams(temperature=0.0, max_tokens=40, structured=schema, close_on_length=True)
    prompts = [
        "Read the following sentence carefully and give me a record of the person it names, with their "
        "name and the number of books they wrote: Ada wrote three books about engines and one about tea.",
        "Another one, please",
    ]
    outs = llm.generate(prompts, params)
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    again = llm.generate(prompts[:1], params)[0]  # the prompt's full blocks now come from the prefix cache
    assert again.num_cached_tokens >= 16 and again.outputs[0].text == outs[0].outputs[0].text


def _cache(model: CausalLM, blocks: int, block_size: int, rollback: int) -> KVCache:
    return KVCache.allocate(model.config, blocks, block_size, model.device, model.dtype, rollback=rollback)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_state_rings_match_transformers(tiny: tuple[torch.nn.Module, CausalLM], block_size: int) -> None:
    """Blocks keeping only their last 7 tokens' compressor states (rollback 0: sparse 2 * 4 - 1,
    heavy 8 - 1), so the rings wrap inside every block: chunks ending inside windows, then greedy
    decode one token per step, every logit row against transformers."""
    hf, model = tiny
    cache = _cache(model, 8, block_size, rollback=0)
    rings = {cache.state_ring(i)[0] for i in (0, 1, 3, 4)}
    assert rings == {7} and cache.states[1] is not None and cache.states[1].shape[1] == 7
    prompt = _prompt(31)
    table = [6, 2, 7, 0, 5, 1, 4, 3][: -(-(PROMPT_LEN + DECODE_STEPS) // block_size)]
    tokens, got, start = list(prompt), [], 0
    for end in (5, 13, 14, 22, 31, 40):
        got.append(_step(model, cache, table, start, prompt[start:end]))
        start = end
    for _ in range(DECODE_STEPS):
        tokens.append(int(got[-1].argmax()))
        got.append(_step(model, cache, table, len(tokens) - 1, tokens[-1:]))
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0]
    rows = [4, 12, 13, 21, 30, *range(PROMPT_LEN - 1, len(tokens))]
    assert (torch.stack(got) - want[rows]).abs().max().item() <= TOL


def test_rejected_draft_within_the_ring_leaves_no_trace(tiny: tuple[torch.nn.Module, CausalLM]) -> None:
    """Rings sized for an 11-token rollback (18 of 32 slots): the draft wraps them, and the true
    tokens after its rejection give the logits of a run that never saw it."""
    _, model = tiny
    prompt, true_tokens, draft = _prompt(21, 37), _prompt(22, 4), _prompt(23, 11)
    table = [2, 0]
    clean = _cache(model, 3, 32, rollback=11)
    assert clean.state_ring(1)[0] == 18 and clean.state_ring(0)[0] == 18
    _step(model, clean, table, 0, prompt)
    want = _step(model, clean, table, 37, true_tokens)
    cache = _cache(model, 3, 32, rollback=11)
    _step(model, cache, table, 0, prompt)
    _step(model, cache, table, 37, draft)
    assert torch.equal(_step(model, cache, table, 37, true_tokens), want)


def test_rollback_deeper_than_the_ring_raises(tiny: tuple[torch.nn.Module, CausalLM]) -> None:
    """Rings sized for no rollback: a rejected 11-token draft overwrote states the true tokens
    need, and the read raises instead of pooling another token's state."""
    _, model = tiny
    prompt, true_tokens, draft = _prompt(21, 37), _prompt(22, 4), _prompt(23, 11)
    table = [5, 1, 3, 0]
    cache = _cache(model, 6, 16, rollback=0)
    _step(model, cache, table, 0, prompt)
    _step(model, cache, table, 37, draft)
    with pytest.raises(EngineError, match=r"compressor states of positions 32\.\.36 were overwritten"):
        _step(model, cache, table, 37, true_tokens)
    # The same through a decode row: its one token closes windows 4 (heavy) and 9 (sparse).
    prompt = _prompt(21, 39)
    cache = _cache(model, 6, 16, rollback=0)
    _step(model, cache, table, 0, prompt)
    _step(model, cache, table, 39, draft)
    with pytest.raises(EngineError, match=r"decode row's windows were overwritten.*7-token state ring"):
        _step(model, cache, table, 39, true_tokens[:1])


@pytest.mark.parametrize(("block_size", "rollback"), [(16, 0), (32, 5), (64, 32), (8, 0), (4, 3)])
def test_bytes_per_block_counts_the_rings(
    tiny: tuple[torch.nn.Module, CausalLM], block_size: int, rollback: int
) -> None:
    """The formula equals the allocated pools' bytes: every layer's window entries, per compressed
    layer ``min(block, (2 if sparse else 1) * rate - 1 + rollback)`` states, its entries, and an
    int32 position per ring slot where the ring is shorter than the block."""
    _, model = tiny
    cache = _cache(model, 2, block_size, rollback)
    pools = [*cache.windows, *cache.states, *cache.entries, *cache.state_positions]
    allocated = sum(p.numel() * p.element_size() for p in pools if p is not None)
    d, di, bs = 32, 16, block_size
    heavy_ring, sparse_ring = min(bs, 7 + rollback), min(bs, 7 + rollback)
    values = 5 * d * bs
    values += 2 * (2 * d * heavy_ring + d * (bs // min(8, bs)))
    values += 2 * (4 * (d + di) * sparse_ring + (d + di) * (bs // min(4, bs)))
    positions = 2 * 4 * heavy_ring * (heavy_ring < bs) + 2 * 4 * sparse_ring * (sparse_ring < bs)
    formula = KVCache.bytes_per_block(model.config, bs, torch.float32, rollback)
    assert formula == values * 4 + positions == allocated // 2


def test_sinkhorn_rows_do_not_depend_on_the_batch() -> None:
    """Each row's Sinkhorn result is the same bits alone and among 1..3000 others (whole-batch sums)."""
    from agent_infer.model.layers.hyper_connections import sinkhorn, sinkhorn_torch

    comb = torch.rand(3000, 4, 4, generator=torch.Generator().manual_seed(0)) + 0.01
    alone = torch.cat([sinkhorn(comb[i : i + 1], 20, 1e-6) for i in range(40)])
    for rows in (2, 3, 5, 16, 17, 3000):
        assert torch.equal(sinkhorn(comb[:rows], 20, 1e-6)[:40], alone[:rows])
    # The CPU's float32 numpy loop and the torch loop of other devices and dtypes give the same bits.
    assert torch.equal(sinkhorn_torch(comb[:40], 20, 1e-6), alone)
    done = sinkhorn(comb[:40], 20, 1e-6)
    assert (done.sum(-1) - 1).abs().max() < 1e-3 and (done.sum(-2) - 1).abs().max() < 1e-3


def test_engine_with_state_rings(tmp_path: Path) -> None:
    """64-token blocks keep 39 states per compressed layer (rollback 32): the engine reports the
    ring layout's bytes, generates valid JSON with its drafts on, and serves a repeated prompt from
    the prefix cache with the same output."""
    from agent_infer import LLM, SamplingParams

    save_tiny_v4(tmp_path, vocab_size=49152)
    write_tokenizer(tmp_path)
    d, di, bs, ring = 32, 16, 64, 39
    values = 5 * d * bs + 2 * (2 * d * ring + d * bs // 8) + 2 * (4 * (d + di) * ring + (d + di) * bs // 4)
    per_block = values * 4 + 4 * 4 * ring  # float32 values, int32 positions of 4 rings
    llm = LLM(model=str(tmp_path), kv_cache_memory_bytes=per_block * 12, block_size=bs)
    runner = llm.engine.runner
    assert runner.num_blocks == 12 and runner.kv_bytes_per_token == per_block / bs
    assert runner.kv_cache.state_ring(1)[0] == ring and runner.kv_cache.state_ring(1)[1] is not None
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = SamplingParams(temperature=0.0, max_tokens=30, structured=schema, close_on_length=True)
    prompt = "Count the books in this sentence and answer with a record holding the number. " * 6
    first = llm.generate([prompt, "Another one, please"], params)
    for out in first:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    again = llm.generate([prompt], params)[0]
    assert again.num_cached_tokens >= bs and again.outputs[0].text == first[0].outputs[0].text


def test_host_kv_tier_restores_every_compressed_pool(tmp_path: Path) -> None:
    """Blocks evicted to the host tier come back with their windows, compressor rings, entries and
    ring positions: the restored run's tokens and logprobs equal the cold run's."""
    from agent_infer import LLM, SamplingParams

    save_tiny_v4(tmp_path, vocab_size=49152)
    write_tokenizer(tmp_path)
    bs = 64
    llm = LLM(
        model=str(tmp_path),
        num_kv_blocks=8,
        block_size=bs,
        host_kv_cache_bytes=64 << 20,
        speculative_tokens=0,
    )
    tier = llm.engine.block_manager.tier
    assert tier is not None and tier.block_bytes == llm.engine.runner.kv_bytes_per_token * bs
    assert llm.engine.runner.kv_cache.state_ring(1)[1] is not None  # ring positions travel too
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)

    def prompt(i: int) -> str:
        return " ".join(f"Agent {i} rule {k}: handle case {k * 7 + i} with care." for k in range(10))

    cold = llm.generate([prompt(0)], params)[0]
    for i in (1, 2, 3):  # other prompts push prompt 0's blocks out of the device pool
        llm.generate([prompt(i)], params)
    assert tier.stats.offloaded > 0
    warm = llm.generate([prompt(0)], params)[0]
    assert tier.stats.restored > 0 and warm.num_cached_tokens >= bs
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert warm.outputs[0].logprobs == cold.outputs[0].logprobs
