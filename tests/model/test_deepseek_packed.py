"""DeepSeek V3/V4 on the packed-float kernels (what ``load_model`` picks for an HF folder on the CPU in
float32): transformers equality through the paged caches, batch invariance, the kernels' own
contracts (packed experts, absorbed MLA decode) and the loader's choice."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from deepseek_support import assert_alone_equals_mixed_batch, load_ours, write_tokenizer
from deepseek_support import save_tiny as save_v3
from deepseek_support import save_tiny_v4 as save_v4

from agent_infer.errors import EngineError
from agent_infer.model.families.base import CausalLM
from agent_infer.model.layers import native_deepseek, native_ops
from agent_infer.model.layers.float_linear import PACKED_FLOAT, FloatPackedLinear, pack_float32
from agent_infer.model.layers.linear import WeightPart
from agent_infer.model.layers.moe import MoE
from agent_infer.model.runner import SequenceRunner

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not native_ops.available(), reason="the native extension is not built")

#: Max abs logit difference allowed against transformers (float32).
TOL = 1e-4
PROMPT_LEN, DECODE_STEPS = 40, 16


def _prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    return torch.randint(2, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model: CausalLM, prompt: list[int], block_size: int) -> tuple[list[int], torch.Tensor]:
    """Prefill then greedy decode through the paged cache: the tokens and every step's logits."""
    runner = SequenceRunner(model, num_blocks=64, block_size=block_size)
    logits = [runner.step([(0, prompt)])[0]]
    tokens = list(prompt)
    for _ in range(DECODE_STEPS):
        tokens.append(int(logits[-1].argmax()))
        logits.append(runner.step([(0, [tokens[-1]])])[0])
    return tokens, torch.stack(logits)


@pytest.mark.parametrize(
    ("version", "block_size"), [("v3", 8), ("v4", 16), ("v4", 4)], ids=["v3-bs8", "v4-bs16", "v4-bs4"]
)
def test_logits_match_transformers_prefill_and_decode(version: str, block_size: int, tmp_path: Path) -> None:
    hf = (save_v3 if version == "v3" else save_v4)(tmp_path)
    ours = load_ours(tmp_path, packed=True)
    assert ours.kernels.name == PACKED_FLOAT and ours.masked_head
    tokens, got = _run(ours, _prompt(0), block_size)
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0, PROMPT_LEN - 1 :]
    assert want.abs().max().item() > 1.0  # unit-scale random weights: the comparison is not vacuous
    assert (got - want).abs().max().item() <= TOL
    assert want[:-1].argmax(-1).tolist() == tokens[PROMPT_LEN:]


def test_chunked_prefill_matches_transformers(tmp_path: Path) -> None:
    """Chunks of at most 16 tokens take the native absorbed decode, longer ones the expanded form."""
    hf = save_v3(tmp_path)
    model = load_ours(tmp_path, packed=True)
    prompt = _prompt(4)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    runner = SequenceRunner(model, num_blocks=16, block_size=8)
    start = 0
    for end in (5, 13, 14, 33, 40):
        got = runner.step([(0, prompt[start:end])])[0]
        assert (got - want[end - 1]).abs().max().item() <= TOL
        start = end


@pytest.mark.parametrize("version", ["v3", "v4"])
def test_batch_invariance_alone_vs_eight_mixed(version: str, tmp_path: Path) -> None:
    """A request's logits are bit-identical alone and in a batch of 8 (prefills, chunks and decodes)."""
    (save_v3 if version == "v3" else save_v4)(tmp_path)
    model = load_ours(tmp_path, packed=True)
    assert_alone_equals_mixed_batch(model)


def test_packed_and_torch_paths_agree(tmp_path: Path) -> None:
    """The packed path computes the torch path's logits up to float rounding."""
    save_v3(tmp_path)
    packed, plain = load_ours(tmp_path, packed=True), load_ours(tmp_path)
    _, a = _run(packed, _prompt(3), 8)
    _, b = _run(plain, _prompt(3), 8)
    assert (a - b).abs().max().item() <= 1e-4


def _moe(limit: float | None, shared: int) -> MoE:
    torch.manual_seed(0)
    moe = MoE(
        64, 24, 8, 2, scoring="sigmoid", score_bias=True, shared_intermediate_size=shared, swiglu_limit=limit
    )
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape) * (1.0 if p.dim() < 2 else p.shape[-1] ** -0.5))
    return moe


@pytest.mark.parametrize(
    ("limit", "shared"), [(None, 24), (0.5, 24), (None, 0)], ids=["plain", "clamped", "no-shared"]
)
def test_packed_experts_match_torch_and_ignore_the_batch(limit: float | None, shared: int) -> None:
    moe = _moe(limit, shared)
    x = torch.randn(37, 64)
    want = moe(x)
    moe.pack_experts(pack_float32)
    got = moe(x)
    assert (got - want).abs().max().item() <= 1e-5
    for rows in (1, 2, 3, 5, 16):  # every row alone or in a small batch: the same bits
        for start in range(0, 37, rows):
            assert torch.equal(moe(x[start : start + rows]), got[start : start + rows])


def test_packed_experts_are_held_once_and_read_back_exactly() -> None:
    moe = _moe(None, 24)
    gate_up, down = moe.gate_up.detach().clone(), moe.down.detach().clone()
    shared = moe.shared_gate_up.detach().clone() if moe.shared_gate_up is not None else None
    want = moe(torch.randn(5, 64))
    assert torch.equal(moe.routed_weights([2])[0], gate_up[[2]])  # before packing: the torch copy
    moe.pack_experts(pack_float32)
    assert moe.gate_up.is_meta and moe.down.is_meta and moe.gate_up.shape == gate_up.shape
    assert moe.shared_gate_up is not None and torch.equal(moe.shared_gate_up, shared)
    up, dn = moe.routed_weights([5, 0, 5])
    assert torch.equal(up, gate_up[[5, 0, 5]]) and torch.equal(dn, down[[5, 0, 5]])
    assert want.shape == moe(torch.randn(5, 64)).shape  # still runs, on the packed copies


def test_packed_experts_reject_bad_input() -> None:
    moe = _moe(None, 24)
    moe.pack_experts(pack_float32)
    assert moe.packed_experts is not None
    x = torch.randn(2, 64)
    with pytest.raises(IndexError, match="routes to expert 8"):
        native_deepseek.run_experts(
            moe.packed_experts, x, torch.tensor([[0, 8], [1, 2]]), torch.ones(2, 2), None
        )
    with pytest.raises(ValueError, match="do not describe"):
        native_deepseek.run_experts(
            moe.packed_experts, x, torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2), None
        )
    gate_up = [pack_float32(torch.randn(48, 64))]
    with pytest.raises(ValueError, match="expert 0 has gate_up"):
        native_deepseek.packed_experts(gate_up, [pack_float32(torch.randn(64, 20))], None, None)


def test_float_packed_linear_rows_are_batch_invariant_and_exact() -> None:
    w = torch.randn(300, 70)
    layer = FloatPackedLinear([WeightPart("w.weight", 300)], 70, bias=False)
    with pytest.raises(EngineError, match="before its weights were loaded and packed"):
        layer.project(torch.randn(2, 70))
    layer.load_targets()["w.weight"][0].copy_(w)
    layer.pack()
    assert layer.weight is None and layer.load_targets() == {}
    x = torch.randn(19, 70)
    full = layer.project(x)
    assert torch.allclose(full, F.linear(x, w), atol=1e-4)
    for i in range(19):
        assert torch.equal(layer.project(x[i : i + 1]), full[i : i + 1])
    with pytest.raises(EngineError, match="packed already"):
        layer.pack()


def test_native_mla_decode_matches_the_torch_absorbed_form(tmp_path: Path) -> None:
    """Decode rows through the native kernel against the torch absorbed form on the same cache."""
    save_v3(tmp_path)
    packed, plain = load_ours(tmp_path, packed=True), load_ours(tmp_path)
    prompts = [_prompt(s, 9 + 7 * s) for s in range(4)]
    got, want = SequenceRunner(packed, 64, 8), SequenceRunner(plain, 64, 8)
    items = [(i, p) for i, p in enumerate(prompts)]
    for _ in range(3):
        a, b = got.step(items), want.step(items)
        assert max((x - y).abs().max().item() for x, y in zip(a, b)) <= 1e-4
        items = [(i, [int(x.argmax())]) for i, x in enumerate(b)]


def test_loader_picks_the_packed_kernels_on_cpu_float32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agent_infer.model.loader import load_model

    save_v3(tmp_path, vocab_size=write_tokenizer(tmp_path))
    assert load_model(tmp_path).model.kernels.name == PACKED_FLOAT
    assert load_model(tmp_path, dtype=torch.bfloat16).model.kernels.name == "torch"
    monkeypatch.setenv("AGENT_INFER_NATIVE_LINEAR", "0")
    assert load_model(tmp_path).model.kernels.name == "torch"


@pytest.mark.parametrize(("hc", "hidden"), [(2, 64), (4, 40)])
def test_native_hyper_connections_match_torch_row_by_row(hc: int, hidden: int) -> None:
    from agent_infer.model.layers.hyper_connections import HyperConnection, HyperHead, expand

    torch.manual_seed(hc)
    site = HyperConnection(hidden, hc, 8, 1e-6, 1e-6, None)
    head = HyperHead(hidden, hc, 1e-6, 1e-6, None)
    with torch.no_grad():
        for p in [*site.parameters(), *head.parameters()]:
            p.copy_(torch.randn(p.shape) * 0.5)
    streams = torch.randn(13, hc, hidden)
    output = torch.randn(13, hidden)
    want = site.collapse(streams)
    want_new = expand(want[0], want[1], output, streams)
    want_head = head(streams)
    site.native = head.native = True
    got = site.collapse(streams)
    for a, b in zip(got, want):
        assert (a - b).abs().max().item() <= 1e-5
    got_new = expand(got[0], got[1], output, streams, native=True)
    assert (got_new - want_new).abs().max().item() <= 1e-5
    assert (head(streams) - want_head).abs().max().item() <= 1e-5
    for i in range(13):  # one row alone: the bits it has in the batch
        alone = site.collapse(streams[i : i + 1])
        assert all(torch.equal(a[0], b[i]) for a, b in zip(alone, got))
        assert torch.equal(
            expand(got[0][i : i + 1], got[1][i : i + 1], output[i : i + 1], streams[i : i + 1], True)[0],
            got_new[i],
        )
        assert torch.equal(head(streams[i : i + 1])[0], head(streams)[i])


def test_native_hyper_connections_reject_bad_shapes() -> None:
    with pytest.raises(ValueError, match=r"a weight \(8, 15\)"):
        native_deepseek.hc_collapse(
            torch.zeros(2, 2, 8), torch.zeros(8, 15), torch.zeros(8), torch.zeros(3), 4, 1e-6, 1e-6
        )
    with pytest.raises(ValueError, match="streams"):
        native_deepseek.hc_head(
            torch.zeros(2, 2, 8, dtype=torch.float64),
            torch.zeros(2, 16),
            torch.zeros(2),
            torch.zeros(1),
            1e-6,
            1e-6,
        )


@pytest.mark.parametrize(
    ("scoring", "groups", "hashed"),
    [("sigmoid", 4, False), ("softmax", 1, False), ("sqrtsoftplus", 1, False), ("sqrtsoftplus", 1, True)],
)
def test_native_router_matches_torch_routing(scoring: str, groups: int, hashed: bool) -> None:
    torch.manual_seed(1)
    moe = MoE(
        32, 16, 16, 3, scoring=scoring, score_bias=not hashed, num_groups=groups, topk_groups=2,  # type: ignore[arg-type]
        routed_scaling_factor=2.5, shared_intermediate_size=16,
    )  # fmt: skip
    with torch.no_grad():
        for name, p in moe.named_parameters():  # unit-scale router logits; experts scaled by fan-in
            p.copy_(torch.randn(p.shape) * (1.0 if name in ("router", "score_bias") else p.shape[-1] ** -0.5))
    x = torch.randn(41, 32)
    fixed = torch.stack([torch.randperm(16)[:3] for _ in range(41)]) if hashed else None
    want_e, want_w = moe.route(x, fixed)
    want = moe(x, fixed)
    moe.pack_experts(pack_float32)
    assert moe.packed_router is not None
    got_e, got_w = native_deepseek.route_packed(moe.packed_router, x, fixed)
    order_w, order_g = want_e.argsort(dim=-1), got_e.argsort(dim=-1)
    assert torch.equal(want_e.gather(1, order_w), got_e.gather(1, order_g))
    assert torch.allclose(want_w.gather(1, order_w), got_w.gather(1, order_g), atol=1e-6)
    out = moe(x, fixed)
    assert (out - want).abs().max().item() <= 1e-5
    for i in range(41):
        assert torch.equal(moe(x[i : i + 1], None if fixed is None else fixed[i : i + 1])[0], out[i])
    if hashed:
        with pytest.raises(IndexError, match="hashed to expert 16"):
            native_deepseek.route_packed(moe.packed_router, x[:1], torch.tensor([[0, 1, 16]]))


def test_moe_with_its_norm_fused_matches_the_separate_norm() -> None:
    from agent_infer.model.layers.norm import RMSNorm

    moe = _moe(0.5, 24)
    norm = RMSNorm(64, 1e-6, None, torch.float32)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(64) + 0.5)
    wide = torch.randn(19, 80)
    x = wide[:, :64]  # rows 80 floats apart: the fused norm reads them in place
    want = moe(norm(x))
    moe.pack_experts(pack_float32)
    got = moe.forward_normed(x, norm)
    assert (got - want).abs().max().item() <= 1e-5
    assert torch.equal(moe.forward_normed(x.contiguous(), norm), got)
    for i in range(19):
        assert torch.equal(moe.forward_normed(x[i : i + 1], norm)[0], got[i])


def test_packed_linear_reads_and_writes_strided_rows_bit_identically() -> None:
    """Row strides (a column slice of a wider matrix in, a column block of a wider output out)
    change where rows lie, not the FMA chain: the same bits as contiguous rows."""
    from agent_infer.model.layers.norm import RMSNorm
    from agent_infer.model.layers.qlinear import QuantLinear

    torch.manual_seed(5)
    layer = QuantLinear.from_float(torch.randn(40, 24))
    wide = torch.randn(9, 60)
    x = wide[:, 10:34]
    want = layer.project(x.contiguous())
    out = torch.full((9, 100), float("nan"))
    layer.packed.forward_raw(x.data_ptr(), 9, out.data_ptr() + 4 * 30, 1, 60, 100)
    assert torch.equal(out[:, 30:70], want)
    assert out[:, :30].isnan().all() and out[:, 70:].isnan().all()
    norm = RMSNorm(24, 1e-6, None, torch.float32)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(24) + 0.5)
    assert torch.equal(layer.project_normed(x, norm), layer.project_normed(x.contiguous(), norm))
    groups = [pack_float32(torch.randn(16, 12)) for _ in range(2)]
    y = torch.randn(7, 24)
    got = native_deepseek.grouped_linear(groups, y)
    for g, p in enumerate(groups):
        part, piece = torch.empty(7, 16), y[:, 12 * g : 12 * g + 12].contiguous()
        p.forward_raw(piece.data_ptr(), 7, part.data_ptr(), 1)
        assert torch.equal(got[:, 16 * g : 16 * g + 16], part)
