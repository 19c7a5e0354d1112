"""Rotary embeddings: native RoPE (engine_native/src/kernels/rope.cpp) in place on the fused qkv rows,
bit-identical to the torch formula."""

from __future__ import annotations

import pytest
import torch

from agent_infer.model.layers import rotary as rope
from agent_infer.model.layers.rotary import NativeRotaryEmbedding, RotaryEmbedding
from agent_infer.native import load_native

_native = load_native()


def _tables(dim: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv)
    return freqs.cos().contiguous(), freqs.sin().contiguous()


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (2, 1, 6)])
def test_rope_rows_equals_the_torch_formula_bit_for_bit(heads: int, kv_heads: int, dim: int) -> None:
    rows, table = 11, 300
    cos, sin = _tables(dim, table)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=gen) * 5
    pos = torch.randint(0, table, (rows,), generator=gen)
    qk_heads = heads + kv_heads
    want = rope.rotate_half(
        qkv[:, : qk_heads * dim].view(rows, qk_heads, dim),
        cos[pos].unsqueeze(1),
        sin[pos].unsqueeze(1),
    )
    v_before = qkv[:, qk_heads * dim :].clone()
    rope.rope_in_place(qkv, qk_heads, dim, cos, sin, pos)
    assert torch.equal(qkv[:, : qk_heads * dim].view(rows, qk_heads, dim), want)
    assert torch.equal(qkv[:, qk_heads * dim :], v_before)  # v heads untouched


def test_rope_rows_rejects_bad_positions_and_shapes() -> None:
    cos, sin = _tables(8, 4)
    qkv = torch.zeros(2, 24)
    with pytest.raises(IndexError, match="position 4 outside the table of 4"):
        rope.rope_in_place(qkv, 2, 8, cos, sin, torch.tensor([0, 4]))
    with pytest.raises(ValueError, match="even head dim"):
        _native.rope_rows(
            qkv.data_ptr(), 2, 24, 4, 8, cos.data_ptr(), sin.data_ptr(), 4, torch.tensor([0, 1]).data_ptr()
        )
    from agent_infer.errors import EngineError

    with pytest.raises(EngineError, match="positions for"):
        rope.rope_in_place(qkv, 2, 8, cos, sin, torch.tensor([0]))


def test_model_logits_identical_with_native_and_torch_rope(monkeypatch: pytest.MonkeyPatch) -> None:
    from agent_infer.model.loader import load_model
    from agent_infer.model.runner import SequenceRunner

    lm = load_model()
    assert lm.model.native and type(lm.model.rotary) is NativeRotaryEmbedding
    ids = lm.tokenizer.encode("The capital of France is Paris. The capital of Italy is")

    def run() -> torch.Tensor:
        runner = SequenceRunner(lm.model, num_blocks=8, block_size=16)
        first = runner.step([(0, ids)])
        return torch.cat([first, runner.step([(0, [int(first.argmax())])])])

    native = run()
    monkeypatch.setattr(lm.model, "rotary", RotaryEmbedding(lm.config, lm.model.device, lm.model.dtype))
    assert torch.equal(run(), native)
