"""The default SmolLM2 GGUF: our paged forward against Hugging Face transformers on the same file.

transformers dequantizes the GGUF with the ``gguf`` package's numpy code and un-permutes q/k itself,
so this checks our torch dequantization, the q/k un-permutation, RoPE, GQA and the paged attention.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from agent_infer.model import AttentionMetadata
from agent_infer.model.loader import LoadedModel, default_model_path, load_model
from agent_infer.model.runner import SequenceRunner

# Max |ours - HF| over all logits must be below this fraction of the largest |HF logit|.
# (Measured: 0.0 on CPU fp32 with torch matmuls - both sides run the same MKL kernels on the same
# weights; 1.3e-4 of a 37.6 logit scale with the native kernel's k-ordered FMA chains.)
RELATIVE_TOLERANCE = 1e-3

MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module", params=[True, False], ids=["native-linear", "torch-linear"])
def ours(request: pytest.FixtureRequest) -> Iterator[LoadedModel]:
    # both matmul paths must match transformers: the packed native kernel and torch fp32 matmuls
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENT_INFER_NATIVE_LINEAR", "1" if request.param else "0")
        lm = load_model(default_model_path(), device=torch.device("cpu"))
    assert lm.model.packed == request.param
    yield lm


@pytest.fixture(scope="module")
def hf_model(ours: LoadedModel) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    c = ours.config
    hf_config = transformers.LlamaConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        rope_theta=c.rope_theta,
        rms_norm_eps=c.rms_norm_eps,
        max_position_embeddings=c.max_position_embeddings,
        tie_word_embeddings=c.tie_word_embeddings,
    )
    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(hf_config)
    # transformers' own GGUF reader: numpy dequantization and its own q/k reverse permutation
    tensors = load_gguf_checkpoint(str(default_model_path()), return_tensors=True, model_to_load=skeleton)[
        "tensors"
    ]
    model = transformers.LlamaForCausalLM(hf_config).eval()
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model


def _prompt(ours: LoadedModel) -> list[int]:
    tok = ours.tokenizer
    return tok.encode(tok.apply_chat_template(MESSAGES))


def test_config_from_metadata(ours: LoadedModel) -> None:
    c = ours.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192 and c.tie_word_embeddings
    assert c.eos_token_ids == (2,)  # <|im_end|> is both the file's EOS and ChatML's end of turn


def test_logits_match_transformers(ours: LoadedModel, hf_model: torch.nn.Module) -> None:
    ids = _prompt(ours)
    runner = SequenceRunner(ours.model, num_blocks=8, block_size=16)
    # all positions' logits, not only the last: run the prefill through the model directly
    n = len(ids)
    table = list(range(7, 7 - (-(-n // 16)), -1))  # non-contiguous, descending blocks
    slots = torch.tensor([table[p // 16] * 16 + p % 16 for p in range(n)])
    meta = AttentionMetadata([0, n], [n], [table], slots, 16)
    hidden = ours.model(torch.tensor(ids), torch.arange(n), meta, runner.cache)
    mine = ours.model.compute_logits(hidden)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    diff = (mine - ref).abs().max().item()
    scale = ref.abs().max().item()
    print(f"max |logit diff| = {diff:.3g} (logit scale {scale:.3g})")
    assert diff <= RELATIVE_TOLERANCE * scale
    assert torch.equal(mine.argmax(-1), ref.argmax(-1))


def test_greedy_generation_matches_transformers(ours: LoadedModel, hf_model: torch.nn.Module) -> None:
    ids = _prompt(ours)
    new = 20
    runner = SequenceRunner(ours.model, num_blocks=16, block_size=16)
    mine = runner.greedy(ids, new)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None)
    ref = out[0, len(ids) :].tolist()
    print("ours:", ours.tokenizer.decode(mine))
    assert mine == ref


def test_chunked_prefill_equals_full_prefill(ours: LoadedModel) -> None:
    ids = _prompt(ours)
    full = SequenceRunner(ours.model, num_blocks=8, block_size=16).step([(0, ids)])
    chunked = SequenceRunner(ours.model, num_blocks=8, block_size=16)
    cut1, cut2 = 13, 29  # chunk boundaries inside blocks
    chunked.step([(0, ids[:cut1])])
    chunked.step([(0, ids[cut1:cut2])])
    last = chunked.step([(0, ids[cut2:])])
    # chunking changes SDPA's query count per call, so allow float noise; the argmax must agree
    assert (full - last).abs().max().item() < 1e-3 * full.abs().max().item()
    assert int(full.argmax()) == int(last.argmax())
