"""DeepSeek V3's MTP module: loading under DeepSeek's names, and our paged module against a plain-torch
reference (DeepSeek's description over transformers' decoder block) on whole sequences."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepseek_support import load_ours, save_tiny, save_tiny_mtp

from agent_infer.errors import ModelLoadError
from agent_infer.model.families.deepseek_v3 import DeepseekV3ForCausalLM
from agent_infer.model.layers.attention import AttentionMetadata, PagedAttention

pytest.importorskip("transformers")

TOL = 1e-4
T = 30


def _tokens(seed: int = 0) -> list[int]:
    return torch.randint(2, 256, (T,), generator=torch.Generator().manual_seed(seed)).tolist()


def _paged_mtp(
    model: DeepseekV3ForCausalLM,
    hidden: torch.Tensor,
    tokens: list[int],
    chunks: list[int],
    block_size: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run MTP module 0 over positions ``0..len(hidden)-1`` in ``chunks`` through a paged latent pool
    whose block table runs backwards; ``(h', logits)`` of every position."""
    mtp = model.mtp_layers()[0]
    assert model.config.mla is not None
    blocks = 32
    pool = torch.zeros(blocks * block_size, model.config.mla.latent_dim)
    table = list(range(blocks - 1, -1, -1))
    outs, logits = [], []
    start = 0
    for end in chunks:
        pos = list(range(start, end))
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in pos])
        meta = AttentionMetadata([0, end - start], [end], [table], slots, block_size)
        plan = PagedAttention().plan(meta, end - start, pool.shape[0], torch.device("cpu"))
        rotation = model.rotary.at(torch.tensor(pos))
        nxt = torch.tensor(tokens[start + 1 : end + 1])
        with torch.no_grad():
            h = mtp.forward(hidden[start:end], nxt, model.embed, rotation, pool, plan)
            outs.append(h)
            logits.append(mtp.logits(h, model.lm_head))
        start = end
    return torch.cat(outs), torch.cat(logits)


@pytest.mark.parametrize("packed", [False, True], ids=["torch", "packed"])
@pytest.mark.parametrize("own_embed_and_head", [True, False], ids=["own-embed-head", "shared-embed-head"])
def test_paged_mtp_matches_reference_on_full_sequences(
    own_embed_and_head: bool, packed: bool, tmp_path: Path
) -> None:
    hf, ref = save_tiny_mtp(tmp_path, with_embed_and_head=own_embed_and_head)
    model = load_ours(tmp_path, packed=packed)
    assert isinstance(model, DeepseekV3ForCausalLM)
    layers = model.mtp_layers()
    assert len(layers) == 1
    # Copies equal to the main embedding and head (DeepSeek's layout) are not kept twice.
    assert (layers[0].embed is not None) == own_embed_and_head
    assert layers[0].block.moe is not None  # index 3 >= first_k_dense_replace: an MoE block, as in V3
    tokens = _tokens()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        main_hf = hf.model(ids).last_hidden_state[0]
        want_h, want_logits = ref(main_hf[:-1], ids[0, 1:], hf.model.rotary_emb)
    # Our main model's final-norm hidden states equal transformers'; the module then runs on ours.
    from agent_infer.model.runner import SequenceRunner

    runner = SequenceRunner(model, num_blocks=16, block_size=8)
    meta_ids = torch.tensor(tokens)
    meta = AttentionMetadata([0, T], [T], [runner._tables.setdefault(0, list(range(15, 11, -1)))],
                             torch.tensor([runner._tables[0][p // 8] * 8 + p % 8 for p in range(T)]), 8)  # fmt: skip
    with torch.no_grad():
        main = model(meta_ids, torch.arange(T), meta, runner.cache)
    assert (main - main_hf).abs().max().item() <= TOL
    assert want_logits.abs().max().item() > 1.0
    for chunks in ([T - 1], [12, 20, 24, 25, 26, 27, 28, 29]):  # one prefill; chunks then one row at a time
        got_h, got_logits = _paged_mtp(model, main[:-1], tokens, chunks)
        assert (got_h - want_h).abs().max().item() <= TOL
        assert (got_logits - want_logits).abs().max().item() <= TOL


def test_copies_of_the_main_embedding_and_head_are_shared(tmp_path: Path) -> None:
    save_tiny_mtp(tmp_path, with_embed_and_head=True, predictable=True)  # stores copies of the main ones
    model = load_ours(tmp_path)
    assert isinstance(model, DeepseekV3ForCausalLM)
    (layer,) = model.mtp_layers()
    assert layer.embed is None and layer.head is None


@pytest.mark.parametrize("packed", [False, True], ids=["torch", "packed"])
def test_chained_step_feeds_its_own_hidden_state(packed: bool, tmp_path: Path) -> None:
    """Depth 2: the module's output at the last position and its proposed token, fed back at the next
    position, equal the reference run on the sequence extended by that pair."""
    hf, ref = save_tiny_mtp(tmp_path)
    model = load_ours(tmp_path, packed=packed)
    tokens = _tokens(1)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        main = hf.model(ids).last_hidden_state[0]
        h1, l1 = ref(main[:-1], ids[0, 1:], hf.model.rotary_emb)
        proposal = int(l1[-1].argmax())
        hidden = torch.cat((main[:-1], h1[-1:]))
        want_h, want_logits = ref(hidden, torch.tensor([*tokens[1:], proposal]), hf.model.rotary_emb)
        got_h, got_logits = _paged_mtp(model, hidden, [*tokens, proposal], [T - 1, T])
    assert (got_h[-1] - want_h[-1]).abs().max().item() <= TOL
    assert (got_logits[-1] - want_logits[-1]).abs().max().item() <= TOL


def test_checkpoint_without_mtp_tensors_loads_without_mtp(tmp_path: Path) -> None:
    save_tiny(tmp_path, num_nextn_predict_layers=1)  # the config names a layer the files do not hold
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    model = load_ours(tmp_path)
    assert isinstance(model, DeepseekV3ForCausalLM) and model.mtp_layers() == []


def test_partial_mtp_tensors_name_the_missing_one(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_tiny_mtp(tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    tensors = load_file(str(path))
    del tensors["model.layers.3.eh_proj.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.3\.eh_proj\.weight"):
        load_ours(tmp_path)


def test_mis_shaped_mtp_head_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_tiny_mtp(tmp_path)
    (path,) = tmp_path.glob("*.safetensors")
    tensors = load_file(str(path))
    tensors["model.layers.3.shared_head.head.weight"] = tensors["model.layers.3.shared_head.head.weight"][:-1]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"shared_head\.head\.weight"):
        load_ours(tmp_path)
