"""The mixture-of-experts layer against a naive per-token reference on random weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from agent_infer.model.layers import moe as moe_module
from agent_infer.model.layers.moe import MoE

HIDDEN, INTER, SHARED_INTER, EXPERTS = 32, 24, 40, 8


def _layer(seed: int = 0, **kw: object) -> MoE:
    layer = MoE(HIDDEN, INTER, EXPERTS, **kw)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(seed)
    for p in layer.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return layer


def _reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: score every expert, take the top k, sum their SwiGLU outputs by weight."""
    out = []
    for row in x:
        logits = layer.router @ row
        scores = logits.softmax(-1) if layer.scoring == "softmax" else logits.sigmoid()
        choice = scores if layer.score_bias is None else scores + layer.score_bias
        chosen = choice.topk(layer.top_k).indices.tolist()
        weights = scores[chosen]
        if layer.renormalize:
            weights = weights / weights.sum()
        weights = weights * layer.routed_scaling_factor
        acc = torch.zeros(HIDDEN)
        for w, e in zip(weights, chosen):
            gate, up = (layer.gate_up[e] @ row).chunk(2)
            acc += w * (layer.down[e] @ (F.silu(gate) * up))
        if layer.shared_gate_up is not None and layer.shared_down is not None:
            gate, up = (layer.shared_gate_up @ row).chunk(2)
            acc += layer.shared_down @ (F.silu(gate) * up)
        out.append(acc)
    return torch.stack(out)


CASES = [
    dict(top_k=2, scoring="softmax", renormalize=False),
    dict(top_k=2, scoring="softmax", renormalize=True, shared_intermediate_size=SHARED_INTER),
    dict(top_k=3, scoring="sigmoid", renormalize=True, routed_scaling_factor=2.5, score_bias=True),
    dict(top_k=1, scoring="sigmoid", renormalize=False, shared_intermediate_size=SHARED_INTER),
    dict(top_k=EXPERTS, scoring="softmax", renormalize=True),
]


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_matches_naive_per_token_reference(kw: dict) -> None:
    layer = _layer(**kw)
    x = torch.randn(37, HIDDEN, generator=torch.Generator().manual_seed(1))
    got = layer(x)
    want = _reference(layer, x)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()


def test_score_bias_changes_the_choice_not_the_weights() -> None:
    layer = _layer(top_k=2, scoring="sigmoid", renormalize=False, score_bias=True)
    x = torch.randn(16, HIDDEN, generator=torch.Generator().manual_seed(2))
    layer.score_bias.data.zero_()  # type: ignore[union-attr]
    layer.score_bias.data[5] = 10.0  # type: ignore[union-attr]
    experts, weights = layer.route(x)
    assert (experts == 5).any(dim=1).all()  # every token now takes expert 5
    scores = (x @ layer.router.T).sigmoid()
    assert torch.allclose(weights, scores.gather(1, experts))  # weighted by its unbiased score


def test_experts_run_only_on_the_tokens_that_chose_them(monkeypatch: pytest.MonkeyPatch) -> None:
    layer = _layer(top_k=2, shared_intermediate_size=SHARED_INTER)
    x = torch.randn(21, HIDDEN, generator=torch.Generator().manual_seed(3))
    rows_run: list[int] = []
    original = moe_module._swiglu

    def spy(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        rows_run.append(int(h.shape[0]))
        return original(h, gate_up, down)

    monkeypatch.setattr(moe_module, "_swiglu", spy)
    experts, _ = layer.route(x)
    layer(x)
    used = sorted(set(experts.flatten().tolist()))
    # one call per chosen expert over exactly its tokens, then the shared experts over all of them
    assert rows_run[:-1] == [int((experts == e).any(dim=1).sum()) for e in used]
    assert sum(rows_run[:-1]) == 21 * 2 and rows_run[-1] == 21


@pytest.mark.parametrize(
    "kw",
    [
        dict(top_k=2, scoring="softmax", renormalize=True, shared_intermediate_size=SHARED_INTER),
        dict(
            top_k=3,
            scoring="sigmoid",
            score_bias=True,
            routed_scaling_factor=2.5,
            num_groups=4,
            topk_groups=2,
        ),
    ],
    ids=["softmax", "sigmoid-grouped"],
)
def test_a_token_output_does_not_depend_on_its_batch(kw: dict) -> None:
    layer = _layer(**kw)
    x = torch.randn(80, HIDDEN, generator=torch.Generator().manual_seed(4))
    batch = layer(x)
    for r in range(80):
        assert torch.equal(layer(x[r : r + 1])[0], batch[r]), r
    assert torch.equal(layer(x[3:11]), batch[3:11])


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError, match="top_k"):
        MoE(HIDDEN, INTER, EXPERTS, top_k=EXPERTS + 1)
    with pytest.raises(ValueError, match="scoring"):
        MoE(HIDDEN, INTER, EXPERTS, top_k=2, scoring="relu")  # type: ignore[arg-type]
