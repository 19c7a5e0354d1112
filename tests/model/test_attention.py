"""Paged attention and KV cache mechanics on a tiny random model (no files needed)."""

from __future__ import annotations

import pytest
import torch

from agent_infer.errors import ConfigError, EngineError, UnsupportedModelError
from agent_infer.model import AttentionMetadata, KVCache, LlamaForCausalLM, ModelConfig
from agent_infer.model.registry import build_model
from agent_infer.model.runner import SequenceRunner


def _config(**kw: object) -> ModelConfig:
    base: dict = dict(
        architecture="llama", vocab_size=97, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    return ModelConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    m = LlamaForCausalLM(_config())
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m


def test_kv_cache_shapes() -> None:
    cfg = _config()
    cache = KVCache.allocate(cfg, num_blocks=5, block_size=4, device=torch.device("cpu"), dtype=torch.float32)
    assert len(cache.k) == len(cache.v) == 2
    assert cache.k[0].shape == (5, 4, 2, 8) and cache.num_slots == 20
    assert KVCache.bytes_per_block(cfg, 4, torch.float32) == 2 * 2 * 4 * 2 * 8 * 4
    assert KVCache.bytes_per_block(cfg, 4, torch.bfloat16) == 2 * 2 * 4 * 2 * 8 * 2
    with pytest.raises(ConfigError):
        KVCache.allocate(cfg, 0, 4, torch.device("cpu"), torch.float32)


def test_config_validation() -> None:
    with pytest.raises(UnsupportedModelError, match="'gpt_neox'; supported: llama, qwen2"):
        build_model(_config(architecture="gpt_neox"))
    with pytest.raises(UnsupportedModelError, match="num_kv_heads"):
        _config(num_kv_heads=3)
    with pytest.raises(UnsupportedModelError, match="longrope"):
        _config(rope_scaling={"type": "longrope", "factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="'yarn' lacks original_max_position_embeddings"):
        _config(rope_scaling={"type": "yarn", "factor": 4.0})


def test_only_new_slots_are_written(model: LlamaForCausalLM) -> None:
    cache = KVCache.allocate(model.config, 4, 4, torch.device("cpu"), torch.float32)
    slots = torch.tensor([13, 14, 15, 4, 5])  # blocks 3 then 1; 5 tokens padded to 8 rows internally
    meta = AttentionMetadata([0, 5], [5], [[3, 1]], slots, 4)
    out = model(torch.tensor([1, 2, 3, 4, 5]), torch.arange(5), meta, cache)
    assert out.shape == (5, 32)
    written = cache.k[0].view(-1, 2, 8).abs().sum(dim=(1, 2)) != 0
    assert written.nonzero().flatten().tolist() == [4, 5, 13, 14, 15]


def test_block_layout_does_not_matter(model: LlamaForCausalLM) -> None:
    ids = list(range(3, 40))
    a = SequenceRunner(model, num_blocks=16, block_size=4).step([(0, ids)])
    b = SequenceRunner(model, num_blocks=3, block_size=16).step([(0, ids)])
    assert torch.allclose(a, b, atol=1e-5)


def test_decode_steps_equal_prefill(model: LlamaForCausalLM) -> None:
    ids = list(range(3, 30))
    full = SequenceRunner(model, num_blocks=8, block_size=4).step([(0, ids)])
    r = SequenceRunner(model, num_blocks=8, block_size=4)
    r.step([(0, ids[:10])])
    for t in ids[10:]:
        last = r.step([(0, [t])])
    assert torch.allclose(full, last, atol=1e-5)


def test_bad_metadata(model: LlamaForCausalLM) -> None:
    cache = KVCache.allocate(model.config, 2, 4, torch.device("cpu"), torch.float32)
    ids, pos = torch.tensor([1, 2]), torch.arange(2)
    cases = [
        AttentionMetadata([0, 1], [2], [[0]], torch.tensor([0, 1]), 4),  # qsl does not cover the batch
        AttentionMetadata([0, 2], [2], [[0], [1]], torch.tensor([0, 1]), 4),  # table count mismatch
        AttentionMetadata([0, 2], [1], [[0]], torch.tensor([0, 1]), 4),  # context shorter than new tokens
        AttentionMetadata([0, 2], [6], [[0]], torch.tensor([4, 5]), 4),  # too few blocks for the context
        AttentionMetadata([0, 2], [2], [[7]], torch.tensor([28, 29]), 4),  # block beyond the pool
        AttentionMetadata([0, 2], [2], [[0]], torch.tensor([0]), 4),  # slot_mapping length
    ]
    for meta in cases:
        with pytest.raises(EngineError):
            model(ids, pos, meta, cache)
    with pytest.raises(EngineError, match="context"):
        model(
            ids, torch.tensor([63, 64]), AttentionMetadata([0, 2], [2], [[0]], torch.tensor([0, 1]), 4), cache
        )


def test_load_weights_errors(model: LlamaForCausalLM) -> None:
    from agent_infer.errors import ModelLoadError

    m = LlamaForCausalLM(_config())
    good = [(n, t) for n, t in _hf_named(model)]
    m.load_weights(good)
    with pytest.raises(ModelLoadError, match="appears twice"):
        m.load_weights([*good, good[0]])
    with pytest.raises(ModelLoadError, match=r"missing tensors: lm_head\.weight"):
        m.load_weights([(n, t) for n, t in good if n != "lm_head.weight"])


def _hf_named(model: LlamaForCausalLM) -> list[tuple[str, torch.Tensor]]:
    c = model.config
    out = [("model.embed_tokens.weight", model.embed), ("model.norm.weight", model.norm.weight)]
    out.append(("lm_head.weight", model.lm_head.weight))
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.qkv.weight.split([c.q_size, c.kv_size, c.kv_size])
        gate, up = layer.mlp.gate_up.weight.chunk(2)
        out += [
            (p + "input_layernorm.weight", layer.input_norm.weight),
            (p + "post_attention_layernorm.weight", layer.post_norm.weight),
            (p + "self_attn.q_proj.weight", q), (p + "self_attn.k_proj.weight", k), (p + "self_attn.v_proj.weight", v),
            (p + "self_attn.o_proj.weight", layer.o.weight), (p + "mlp.gate_proj.weight", gate),
            (p + "mlp.up_proj.weight", up), (p + "mlp.down_proj.weight", layer.mlp.down.weight),
        ]  # fmt: skip
    return out
