"""DeepSeek V3's multi-head latent attention on the packed-float path: a row's bits depend only on its
token and the context before it. The tiled chunk kernel (kernels/attention_mla_rows.cpp) equals the
single-row decode kernel bit for bit, so a prompt's logits do not move with how the engine chunked it,
what the prefix cache held, or what else was in the batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from deepseek_support import load_ours
from deepseek_support import save_tiny as save_v3

from agent_infer import SamplingParams
from agent_infer.llm import LLM
from agent_infer.model.families.base import CausalLM
from agent_infer.model.layers import native_mla, native_ops
from agent_infer.model.layers.float_linear import PACKED_FLOAT
from agent_infer.model.runner import SequenceRunner

pytestmark = pytest.mark.skipif(not native_ops.available(), reason="the native extension is not built")

REPO = Path(__file__).resolve().parents[2]
TRAINED = REPO / "checkpoints" / "tiny-deepseek-v3"

HEADS, NOPE, ROPE, V = 3, 16, 8, 12
SLOTS, BLOCK = 256, 4


def _inputs(rows: int, seed: int, lora: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # q_nope and q_rope are strided views of one wider tensor, as the model hands them over.
    q = torch.randn(rows, HEADS, NOPE + ROPE + 3, generator=g)
    return {
        "cache": torch.randn(SLOTS, lora + ROPE, generator=g),
        "kv_b": torch.randn(HEADS * (NOPE + V), lora, generator=g) * 0.3,
        "qn": q[:, :, :NOPE],
        "qr": q[:, :, NOPE : NOPE + ROPE],
        "blocks": torch.randperm(SLOTS // BLOCK, generator=g),
    }


def _args(t: dict[str, torch.Tensor], out: torch.Tensor, threads: int) -> tuple[object, ...]:
    qn, qr, lora = t["qn"], t["qr"], int(t["kv_b"].shape[1])
    return (
        qn.data_ptr(), qr.data_ptr(), t["cache"].data_ptr(), t["kv_b"].data_ptr(), out.data_ptr(), HEADS, NOPE,
        ROPE, lora, V, 0.37, threads, qn.stride(0), qn.stride(1), qr.stride(0), qr.stride(1),
    )  # fmt: skip


def _decode_rows(t: dict[str, torch.Tensor], seqs: list[tuple[int, int, int, torch.Tensor]]) -> torch.Tensor:
    """Every row of ``seqs`` (first row, rows, context, block table) through the decode kernel alone."""
    rows = int(t["qn"].shape[0])
    r, tables, ctx = [], [], []
    for start, n, c, table in seqs:
        for j in range(n):
            r.append(start + j)
            tables.append(table)
            ctx.append(c - n + j + 1)
    out = torch.full((rows, HEADS * V), float("nan"))
    batch = native_ops.decode_batch(
        torch.tensor(r), torch.stack(tables), torch.tensor(ctx), BLOCK, rows, SLOTS
    )
    batch.run_mla(*_args(t, out, 1))
    return out


def _slots(table: torch.Tensor, ctx: int) -> torch.Tensor:
    return (table[:, None] * BLOCK + torch.arange(BLOCK)[None]).reshape(-1)[:ctx]


# lora 32: the AVX-512 kernel's path (lora a multiple of 16); 40: the generic one on every machine.
@pytest.mark.parametrize("lora", [32, 40])
@pytest.mark.parametrize(
    ("lengths", "cached"),
    [([1], [0]), ([15], [0]), ([16], [3]), ([17], [0]), ([33], [7]), ([5, 40, 16], [1, 0, 9]), ([47], [30])],
    ids=["one", "15", "16+3", "17", "33+7", "three-seqs", "47+30"],
)
def test_tiled_rows_equal_single_row_kernel(lengths: list[int], cached: list[int], lora: int) -> None:
    total = sum(lengths)
    t = _inputs(total + 2, seed=total, lora=lora)
    seqs, start = [], 0
    blocks = t["blocks"]
    for i, (n, c0) in enumerate(zip(lengths, cached)):
        need = (n + c0 + BLOCK - 1) // BLOCK
        table = torch.zeros(20, dtype=torch.int64)
        table[:need] = blocks[i * 20 : i * 20 + need]
        seqs.append((start, n, n + c0, table))
        start += n
    want = _decode_rows(t, seqs)
    spans = torch.tensor([[s, n, c] for s, n, c, _ in seqs])
    slots = torch.cat([_slots(table, c) for _, _, c, table in seqs])
    rows = native_mla.mla_rows(spans, slots, total + 2, SLOTS)
    assert rows.num_tiles == sum((n + 15) // 16 for n in lengths)
    for threads in (1, 2):
        got = torch.full_like(want, float("nan"))
        rows.run(*_args(t, got, threads))
        assert torch.equal(got[:total], want[:total])
        assert got[:total].abs().max().item() > 0.1
        assert got[total:].isnan().all()  # rows outside every chunk are left alone


def test_chunk_kernel_rejects_bad_spans() -> None:
    slots = torch.arange(10)
    with pytest.raises(ValueError, match="rows <= context"):
        native_mla.mla_rows(torch.tensor([[0, 11, 10]]), slots, 20, SLOTS)
    with pytest.raises(IndexError, match="rows outside q"):
        native_mla.mla_rows(torch.tensor([[15, 10, 10]]), slots, 20, SLOTS)
    with pytest.raises(IndexError, match="slot outside the cache"):
        native_mla.mla_rows(torch.tensor([[0, 5, 10]]), slots + SLOTS - 5, 20, SLOTS)
    with pytest.raises(ValueError, match="past the end of slots"):
        native_mla.mla_rows(torch.tensor([[0, 5, 11]]), slots, 20, SLOTS)
    with pytest.raises(ValueError, match="no sequence uses"):
        native_mla.mla_rows(torch.tensor([[0, 5, 9]]), slots, 20, SLOTS)
    with pytest.raises(ValueError, match="int64"):
        native_mla.mla_rows(torch.tensor([[0, 5, 10]], dtype=torch.int32), slots, 20, SLOTS)


def _chunked(model: CausalLM, prompt: list[int], cuts: list[int], steps: int) -> torch.Tensor:
    """The last prompt position's logits after prefilling ``prompt`` in chunks ending at ``cuts``,
    then ``steps`` greedy decode steps' logits."""
    runner = SequenceRunner(model, num_blocks=64, block_size=8)
    begin = 0
    for end in [*cuts, len(prompt)]:
        logits = runner.step([(0, prompt[begin:end])])[0]
        begin = end
    out = [logits]
    for _ in range(steps):
        out.append(runner.step([(0, [int(out[-1].argmax())])])[0])
    return torch.stack(out)


def test_chunking_leaves_prompt_logits_bitwise(tmp_path: Path) -> None:
    save_v3(tmp_path)
    model = load_ours(tmp_path, packed=True)
    assert model.kernels.name == PACKED_FLOAT
    prompt = torch.randint(2, 256, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    want = _chunked(model, prompt, [], 4)
    # 16-token chunks take the decode kernel, longer ones the tiled one; single tokens decode.
    for cuts in ([16], [17, 40], [1, 2, 35], [53], [69], list(range(1, 70))):
        assert torch.equal(_chunked(model, prompt, cuts, 4), want), cuts


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(11)
    shared = torch.randint(100, 20000, (260,), generator=g).tolist()
    return {
        "p": shared + torch.randint(100, 20000, (37,), generator=g).tolist(),
        "q": shared + torch.randint(100, 20000, (21,), generator=g).tolist(),
        "short": torch.randint(100, 20000, (9,), generator=g).tolist(),
        "long": torch.randint(100, 20000, (150,), generator=g).tolist(),
    }


def _outputs(llm: LLM, batch: list[list[int]], params: SamplingParams) -> list[tuple[list[int], object]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(batch, params)]


@pytest.mark.skipif(not TRAINED.is_dir(), reason=f"{TRAINED} is not in this checkout")
def test_trained_v3_bits_independent_of_chunking_cache_and_batch(prompts: dict[str, list[int]]) -> None:
    torch.set_num_threads(1)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, logprobs=4)
    p, q = prompts["p"], prompts["q"]
    llm = LLM(model=str(TRAINED), kv_cache_memory_bytes=16 * 1024 * 1024)
    [cold] = _outputs(llm, [p], greedy)
    assert cold[1] and len(cold[0]) == 6
    _outputs(llm, [q], greedy)
    # p again: its shared prefix (and its own blocks) come from the cache, the rest is recomputed.
    assert _outputs(llm, [p], greedy) == [cold]
    mixed = _outputs(llm, [prompts["long"], p, prompts["short"], q], greedy)
    assert mixed[1] == cold
    del llm
    for budget in (64, 100):
        chunked = LLM(
            model=str(TRAINED), kv_cache_memory_bytes=16 * 1024 * 1024, max_num_batched_tokens=budget,
            enable_prefix_caching=False,
        )  # fmt: skip
        assert _outputs(chunked, [prompts["short"], p], greedy)[1] == cold, budget
        del chunked


@pytest.mark.skipif(not TRAINED.is_dir(), reason=f"{TRAINED} is not in this checkout")
def test_trained_v3_seeded_sample_repeats_in_one_process(prompts: dict[str, list[int]]) -> None:
    torch.set_num_threads(1)
    llm = LLM(model=str(TRAINED), kv_cache_memory_bytes=16 * 1024 * 1024)
    batch = [prompts["p"], prompts["q"], prompts["long"]]
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, logprobs=2)
    first = _outputs(llm, batch, params)
    assert _outputs(llm, batch, params) == first
    assert _outputs(llm, [prompts["q"]], params) == [first[1]]
