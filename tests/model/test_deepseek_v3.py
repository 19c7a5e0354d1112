"""DeepSeek V3 against transformers on tiny random checkpoints: logits through the latent paged cache,
the cache entries themselves, absorbed vs expanded attention, MoE routing, and a run through the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepseek_support import load_ours, save_tiny, tiny_config, write_tokenizer

from agent_infer.model.kv_cache import KVCache
from agent_infer.model.layers.moe import MoE
from agent_infer.model.runner import SequenceRunner

transformers = pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")

#: Max abs logit difference allowed against transformers (float32; logits are O(1)-O(10)).
TOL = 1e-4
PROMPT_LEN, DECODE_STEPS = 40, 16  # positions past original_max_position_embeddings=32 exercise YaRN


def _prompt(seed: int = 0, vocab: int = 256) -> list[int]:
    return torch.randint(2, vocab, (PROMPT_LEN,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model: torch.nn.Module, prompt: list[int], block_size: int = 8) -> tuple[list[int], torch.Tensor]:
    """Prefill then greedy decode through the paged cache: the tokens and every step's logits."""
    runner = SequenceRunner(model, num_blocks=16, block_size=block_size)  # type: ignore[arg-type]
    logits = [runner.step([(0, prompt)])[0]]
    tokens = list(prompt)
    for _ in range(DECODE_STEPS):
        tokens.append(int(logits[-1].argmax()))
        logits.append(runner.step([(0, [tokens[-1]])])[0])
    return tokens, torch.stack(logits)


@pytest.mark.parametrize(
    ("q_lora_rank", "yarn"),
    [(48, True), (None, True), (48, False)],
    ids=["q_lora-yarn", "q_full-yarn", "q_lora-plain"],
)
def test_logits_match_transformers_prefill_and_decode(
    q_lora_rank: int | None, yarn: bool, tmp_path: Path
) -> None:
    hf = save_tiny(tmp_path, q_lora_rank=q_lora_rank, yarn=yarn)
    ours = load_ours(tmp_path)
    tokens, got = _run(ours, _prompt())
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0, PROMPT_LEN - 1 :]
    assert want.abs().max().item() > 1.0  # random weights of unit scale: the comparison is not vacuous
    assert (got - want).abs().max().item() <= TOL
    # greedy continuation identical: every token we chose is transformers' argmax at that position
    assert want[:-1].argmax(-1).tolist() == tokens[PROMPT_LEN:]


def test_chunked_prefill_matches_transformers(tmp_path: Path) -> None:
    """Chunks after the first attend to cached latents with a bottom-right causal mask, in both forms."""
    hf = save_tiny(tmp_path)
    model = load_ours(tmp_path)
    prompt = _prompt(4)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0]
    runner = SequenceRunner(model, num_blocks=16, block_size=8)
    ends = [12, 32, 37, 40]  # chunks of 12, 20 (expanded, masked), 5 (absorbed, masked) and 3 tokens
    start = 0
    for end in ends:
        got = runner.step([(0, prompt[start:end])])[0]
        assert (got - want[end - 1]).abs().max().item() <= TOL
        start = end


def test_cache_holds_the_latent_and_the_rotated_key(tmp_path: Path) -> None:
    hf = save_tiny(tmp_path)
    ours = load_ours(tmp_path)
    c = ours.config
    assert c.mla is not None
    cache = KVCache.allocate(c, 16, 8, torch.device("cpu"), torch.float32)
    assert cache.layout == "latent" and not cache.k and not cache.v
    assert tuple(cache.latents[0].shape) == (16, 8, c.mla.kv_lora_rank + c.mla.qk_rope_head_dim)
    per_token = c.num_layers * (c.mla.kv_lora_rank + c.mla.qk_rope_head_dim)
    assert KVCache.values_per_token(c) == per_token == 3 * (32 + 8)
    assert KVCache.bytes_per_block(c, 8, torch.bfloat16) == per_token * 8 * 2

    prompt = _prompt(1)
    runner = SequenceRunner(ours, num_blocks=16, block_size=8)
    runner.step([(0, prompt)])
    table = runner._tables[0]
    slots = torch.tensor([table[p // 8] * 8 + p % 8 for p in range(len(prompt))])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt]), use_cache=True).past_key_values
    for i in range(c.num_layers):
        entries = runner.cache.latent(i)[slots]
        assert torch.allclose(entries[:, :32], ref.layers[i].keys[0, 0], atol=1e-5)  # normalized latent
        assert torch.allclose(entries[:, 32:], ref.layers[i].values[0, 0], atol=1e-5)  # rotated shared key


@pytest.mark.parametrize("q_lora_rank", [48, None])
def test_absorbed_decode_equals_expanded_form(q_lora_rank: int | None, tmp_path: Path) -> None:
    save_tiny(tmp_path, q_lora_rank=q_lora_rank)
    model = load_ours(tmp_path)
    results = []
    for limit in (0, 10**6):  # every chunk expanded, then every chunk (prefill included) absorbed
        for layer in model.blocks():
            layer.attn.absorb_max_query = limit
        results.append(_run(model, _prompt(2)))
    (tokens_x, expanded), (tokens_a, absorbed) = results
    assert tokens_x == tokens_a
    assert (expanded - absorbed).abs().max().item() <= 1e-5 * max(1.0, expanded.abs().max().item())


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_moe_routing_and_output_match_transformers(norm_topk_prob: bool) -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = tiny_config(
        norm_topk_prob=norm_topk_prob, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4
    )
    torch.manual_seed(3)
    ref = DeepseekV3MoE(cfg).eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        ref.gate.weight.copy_(torch.randn(ref.gate.weight.shape, generator=gen))
        ref.gate.e_score_correction_bias.copy_(0.3 * torch.randn(16, generator=gen))
        ref.experts.gate_up_proj.copy_(torch.randn(ref.experts.gate_up_proj.shape, generator=gen) / 8)
        ref.experts.down_proj.copy_(torch.randn(ref.experts.down_proj.shape, generator=gen) / 6)
    ours = MoE(
        64, 32, 16, 4, scoring="sigmoid", renormalize=norm_topk_prob, routed_scaling_factor=2.5,
        score_bias=True, shared_intermediate_size=32, num_groups=4, topk_groups=2,
    )  # fmt: skip
    with torch.no_grad():
        ours.router.copy_(ref.gate.weight)
        assert (
            ours.score_bias is not None and ours.shared_gate_up is not None and ours.shared_down is not None
        )
        ours.score_bias.copy_(ref.gate.e_score_correction_bias)
        ours.gate_up.copy_(ref.experts.gate_up_proj)
        ours.down.copy_(ref.experts.down_proj)
        se = ref.shared_experts
        ours.shared_gate_up.copy_(torch.cat((se.gate_proj.weight, se.up_proj.weight)))
        ours.shared_down.copy_(se.down_proj.weight)
    x = torch.randn(96, 64, generator=gen)
    with torch.no_grad():
        _, ref_weights, ref_experts = ref.gate(x)
        want = ref(x[None])[0]
    experts, weights = ours.route(x)
    ref_order, order = ref_experts.argsort(-1), experts.argsort(-1)
    assert torch.equal(ref_experts.gather(1, ref_order), experts.gather(1, order))
    assert torch.allclose(ref_weights.gather(1, ref_order), weights.gather(1, order), atol=1e-6)
    # group limit: every token's experts lie in at most topk_group of the 4 groups of 4
    assert max(len(set((experts[t] // 4).tolist())) for t in range(96)) <= 2
    assert torch.allclose(ours(x), want, atol=1e-5)


def test_batch_invariance_with_moe(tmp_path: Path) -> None:
    """A sequence's logits are bit-identical alone and in a batch of mixed prefill and decode rows."""
    save_tiny(tmp_path)
    model = load_ours(tmp_path)
    prompts = [_prompt(seed)[: 5 + 4 * seed] for seed in range(8)]
    alone = []
    for i, p in enumerate(prompts):
        runner = SequenceRunner(model, num_blocks=64, block_size=8)
        first = runner.step([(i, p)])[0]
        alone.append((first, runner.step([(i, [int(first.argmax())])])[0]))
    batched = SequenceRunner(model, num_blocks=64, block_size=8)
    firsts = batched.step([(i, p) for i, p in enumerate(prompts[:4])])  # 4 prefills together
    # then 4 decodes batched with the other 4 prefills
    mixed = batched.step(
        [(i, [int(firsts[i].argmax())]) for i in range(4)] + [(i, p) for i, p in enumerate(prompts) if i >= 4]
    )
    for i in range(4):
        assert torch.equal(firsts[i], alone[i][0]) and torch.equal(mixed[i], alone[i][1])
    for i in range(4, 8):
        assert torch.equal(mixed[i], alone[i][0])


def test_engine_generates_schema_valid_json(tmp_path: Path) -> None:
    from agent_infer import LLM, SamplingParams

    save_tiny(tmp_path, vocab_size=49152)  # covers the SmolLM2 tokenizer's ids
    assert write_tokenizer(tmp_path) <= 49152
    per_token = 3 * (32 + 8) * 4  # layers * (kv_lora_rank + qk_rope_head_dim) * float32
    llm = LLM(model=str(tmp_path), kv_cache_memory_bytes=per_token * 16 * 40 + 100, block_size=16)
    runner = llm.engine.runner
    assert runner.kv_cache.layout == "latent" and runner.kv_bytes_per_token == per_token
    assert runner.num_blocks == 40  # the pool is sized by the latent entry, not expanded K/V
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
