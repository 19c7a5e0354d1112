"""The native row argmax greedy sampling uses: torch.argmax's indices on every kind of row."""

from __future__ import annotations

import pytest
import torch

from agent_infer.model.layers import native_ops

pytestmark = pytest.mark.skipif(not native_ops.available(), reason="the native extension is not built")


@pytest.mark.parametrize("width", [1, 15, 16, 17, 31, 129280])
def test_argmax_rows_equals_torch(width: int) -> None:
    gen = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=gen)
    x[1] = float("-inf")  # all -inf: index 0
    x[2] = 0.0  # ties everywhere: the first
    if width > 3:
        x[3, width - 1] = x[3, 1] = 50.0  # a tie between lanes and blocks: the first
        x[4, 2] = x[4, width - 2] = float("nan")  # the first NaN wins
        x[5, width // 2] = float("inf")
        x[6, 0], x[6, width - 1] = -0.0, 0.0
        x[6, 1:-1] = -1.0
    x[7, -1] = float("nan")
    want = x.argmax(dim=-1).tolist()
    assert native_ops.argmax_rows(x) == want
    assert native_ops.argmax_rows(x[:, :]) == want
    assert native_ops.argmax_rows(x.t().contiguous().t()) == want  # non-contiguous: torch's own path
    assert native_ops.argmax_rows(x.double()) == want
    assert native_ops.argmax_rows(x[:0]) == []


def test_argmax_rows_rejects_bad_arrays() -> None:
    from agent_infer import _native

    with pytest.raises(TypeError):
        _native.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-D"):
        _native.argmax_rows(torch.zeros(3))
    with pytest.raises(ValueError, match="empty"):
        _native.argmax_rows(torch.zeros(2, 0))
