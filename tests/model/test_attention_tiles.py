"""The multi-row (tiled) form of the native attention kernel against its single-row form.

A chunk's consecutive query rows of one sequence run as tiles that load each key and value once;
the same rows handed to the kernel in an order that cannot be tiled run one by one. Both must give
the same bits for every head dim (the AVX-512 register paths and the generic path), GQA group,
block size, chunk length and tile edge.
"""

from __future__ import annotations

import pytest
import torch

from agent_infer.model.layers import native_ops
from agent_infer.model.layers.attention import AttentionMetadata, NativePagedAttention, PagedAttention

pytestmark = pytest.mark.skipif(not native_ops.available(), reason="native extension not built")


def _chunk_case(
    chunks: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, block_size: int, seed: int
) -> tuple[torch.Tensor, ...]:
    """Sequences with ``(new, cached)`` tokens: one entry per new row, context lengths ascending."""
    gen = torch.Generator().manual_seed(seed)
    totals = [n + c for n, c in chunks]
    num_blocks = sum(-(-t // block_size) for t in totals) + 2
    k = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen)
    v = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen)
    num_rows = sum(n for n, _ in chunks)
    q = torch.randn(num_rows, heads, dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, non-monotonic blocks
    width = max(-(-t // block_size) for t in totals)
    rows, ctx, tables = [], [], []
    row = 0
    for n, cached in chunks:
        blocks = [perm.pop() for _ in range(-(-(n + cached) // block_size))]
        for j in range(n):
            rows.append(row)
            ctx.append(cached + j + 1)
            tables.append(blocks + [0] * (width - len(blocks)))
            row += 1
    return (
        q, k, v, torch.tensor(rows, dtype=torch.int64), torch.tensor(tables, dtype=torch.int64),
        torch.tensor(ctx, dtype=torch.int64),
    )  # fmt: skip


def _run(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, tables: torch.Tensor,
    ctx: torch.Tensor, block_size: int, order: torch.Tensor, threads: int,
) -> torch.Tensor:  # fmt: skip
    out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), float("nan"))
    batch = native_ops.decode_batch(
        rows[order], tables[order], ctx[order], block_size, q.shape[0], k.shape[0]
    )
    batch.run(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), q.shape[1], k.shape[1], q.shape[2],
        q.shape[2] ** -0.5, threads,
    )  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size"),
    [(9, 3, 64, 16), (4, 4, 32, 5), (8, 2, 128, 16), (6, 2, 8, 4), (4, 1, 256, 7), (3, 1, 80, 3)],
)
def test_tiles_equal_single_rows(heads: int, kv_heads: int, dim: int, block_size: int) -> None:
    """Tiled rows equal the same rows run one by one (reversed entries never form a tile)."""
    chunks = [(37, 0), (1, 20), (16, 3), (9, 50), (2, 0), (23, 17)]
    q, k, v, rows, tables, ctx = _chunk_case(chunks, heads, kv_heads, dim, block_size, seed=dim + block_size)
    forward = torch.arange(len(rows))
    single = _run(q, k, v, rows, tables, ctx, block_size, forward.flip(0), 1)
    assert not single.isnan().any()
    for threads in (1, 2):
        tiled = _run(q, k, v, rows, tables, ctx, block_size, forward, threads)
        assert torch.equal(tiled, single), (
            f"threads={threads} max diff {(tiled - single).abs().max().item():.3g}"
        )
    # a tile cut anywhere (here: every row split from its predecessor at odd places) changes nothing
    shuffled = torch.cat([forward[::3], forward[1::3], forward[2::3]])
    assert torch.equal(_run(q, k, v, rows, tables, ctx, block_size, shuffled, 2), single)


def test_tiles_match_reference_attention() -> None:
    """The tiled kernel is causal attention: within rounding of a float64 reference."""
    block_size, chunks = 8, [(45, 12)]
    q, k, v, rows, tables, ctx = _chunk_case(chunks, 6, 2, 64, block_size, seed=3)
    out = _run(q, k, v, rows, tables, ctx, block_size, torch.arange(len(rows)), 2).view(q.shape)
    slots = (tables[-1][:, None] * block_size + torch.arange(block_size)).reshape(-1)[: int(ctx[-1])]
    keys, vals = k[slots].double().repeat_interleave(3, 1), v[slots].double().repeat_interleave(3, 1)
    for r in range(len(rows)):
        c = int(ctx[r])
        w = torch.softmax(torch.einsum("hd,khd->hk", q[r].double(), keys[:c]) / 8.0, dim=-1)
        ref = torch.einsum("hk,khd->hd", w, vals[:c]).float()
        torch.testing.assert_close(out[r], ref, rtol=1e-5, atol=1e-5)


def _attend(
    attn: PagedAttention,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cuts: list[int],
    window: int | None,
) -> torch.Tensor:
    """Feed one sequence's rows in chunks ending at ``cuts`` through ``attn``; the rows' outputs."""
    bs, kv_heads, dim = 4, k.shape[1], k.shape[2]
    blocks = list(range(-(-q.shape[0] // bs)))[::-1]  # descending ids: a scattered table
    k_cache = torch.zeros(len(blocks) * bs, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(q.shape[0])])
    outs, start = [], 0
    for end in cuts:
        meta = AttentionMetadata([0, end - start], [end], [blocks], slots[start:end], bs)
        plan = attn.plan(meta, end - start, k_cache.shape[0], torch.device("cpu"), sliding_window=window)
        outs.append(attn(q[start:end], k[start:end], v[start:end], k_cache, v_cache, plan))
        start = end
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 7, 40])
def test_chunks_cut_anywhere_give_the_same_bits(window: int | None) -> None:
    """Through the attention layer (plans included, sliding windows too): a sequence prefilled
    whole, in chunks or token by token gives the same bits on the native path, and matches SDPA."""
    gen = torch.Generator().manual_seed(window or 0)
    n, heads, kv_heads, dim = 77, 6, 2, 32
    q, k, v = (torch.randn(n, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    native = NativePagedAttention()
    whole = _attend(native, q, k, v, [n], window)
    assert torch.equal(_attend(native, q, k, v, [20, 21, 60, n], window), whole)
    assert torch.equal(_attend(native, q, k, v, list(range(1, n + 1)), window), whole)
    torch.testing.assert_close(_attend(PagedAttention(), q, k, v, [n], window), whole, rtol=1e-5, atol=1e-5)


def test_shared_tables_equal_a_table_per_row() -> None:
    """Rows naming their chunk's one table (``table_rows``) give the bits of a table copy per row;
    an index outside the tables or of the wrong length is refused with a typed error."""
    chunks, bs = [(30, 5), (1, 9), (12, 0)], 4
    q, k, v, rows, tables, ctx = _chunk_case(chunks, 6, 2, 64, bs, seed=11)
    per_row = _run(q, k, v, rows, tables, ctx, bs, torch.arange(len(rows)), 2)
    firsts = torch.tensor([0, 30, 31])
    table_rows = torch.repeat_interleave(torch.arange(3), torch.tensor([n for n, _ in chunks]))
    shared = native_ops.decode_batch(
        rows, tables[firsts].contiguous(), ctx, bs, q.shape[0], k.shape[0], table_rows
    )
    out = torch.full_like(per_row, float("nan"))
    shared.run(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), 6, 2, 64, 64**-0.5, 2)
    assert torch.equal(out, per_row)
    with pytest.raises(IndexError, match="table_rows"):
        native_ops.decode_batch(
            rows, tables[firsts].contiguous(), ctx, bs, q.shape[0], k.shape[0], table_rows + 1
        )
    with pytest.raises(ValueError, match="table_rows"):
        native_ops.decode_batch(
            rows, tables[firsts].contiguous(), ctx, bs, q.shape[0], k.shape[0], table_rows[1:]
        )
