"""Tiny random DeepSeek V3 and V4 checkpoints saved with transformers (the oracle), a direct loader for
them, tokenizers for their folders and a reference MTP module (quantized layouts:
deepseek_quant_support.py)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from agent_infer.model.families.base import CausalLM
from agent_infer.model.loader import default_model_path
from agent_infer.model.loading.fp8_select import hf_kernels
from agent_infer.model.loading.gguf_reader import GGUFFile
from agent_infer.model.loading.hf import hf_config, hf_weights
from agent_infer.model.registry import build_model
from agent_infer.model.runner import SequenceRunner
from agent_infer.model.tokenizer import Tokenizer

YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
}  # fmt: skip


def tiny_config(*, q_lora_rank: int | None = 48, yarn: bool = True, **overrides: Any) -> Any:
    """A 3-layer DeepseekV3Config: one dense layer then two MoE layers of 8 experts in 4 groups."""
    import transformers

    kw: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=q_lora_rank, qk_rope_head_dim=8,
        v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3,
        first_k_dense_replace=1, max_position_embeddings=128, num_nextn_predict_layers=0,
        tie_word_embeddings=False, eos_token_id=0, bos_token_id=1,
        rope_parameters=dict(YARN) if yarn else {"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    kw.update(overrides)
    return transformers.DeepseekV3Config(**kw)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale activations (transformers' 0.02 init makes every logit nearly equal), norms and
    mixing scales near one, a correction bias that changes which experts are chosen, and (V4) a hash
    table routing each token to distinct experts."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                order = torch.rand(p.shape[0], int(model.config.n_routed_experts), generator=gen).argsort(
                    dim=-1
                )
                p.copy_(order[:, : p.shape[1]])
                continue
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.2 * noise)
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def save_tiny(directory: Path, seed: int = 0, **config: Any) -> Any:
    """Save a randomized tiny V3 model to ``directory``; returns the transformers model (eval, float32)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(tiny_config(**config)).eval()
    randomize(model, seed)
    model.save_pretrained(directory)
    return model


#: V4: every attention kind and both routings: heavy, sparse, sliding-only, sparse, heavy; two hash layers.
V4_LAYER_TYPES = [
    "heavily_compressed_attention",
    "compressed_sparse_attention",
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
]
V4_MLP_TYPES = ["hash_moe", "hash_moe", "moe", "moe", "moe"]
V4_COMPRESS_YARN = {
    "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
}  # fmt: skip


def tiny_v4_config(*, yarn: bool = False, **overrides: Any) -> Any:
    """A 5-layer DeepseekV4Config of 8 experts: CSA (rate 4, top-3 indexer) and HCA (rate 8) layers,
    a sliding-only layer, an 8-token window, and a low ``swiglu_limit`` that clamps."""
    import transformers

    kw: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
        head_dim=32, partial_rotary_factor=0.25, q_lora_rank=48, num_experts_per_tok=2, n_routed_experts=8,
        layer_types=list(V4_LAYER_TYPES), mlp_layer_types=list(V4_MLP_TYPES),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3,
        hc_mult=4, hc_sinkhorn_iters=20, swiglu_limit=1.5, routed_scaling_factor=1.5,
        num_nextn_predict_layers=0, max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=0, bos_token_id=1,
    )  # fmt: skip
    if yarn:
        kw["rope_parameters"] = dict(V4_COMPRESS_YARN)
    kw.update(overrides)
    return transformers.DeepseekV4Config(**kw)


def save_tiny_v4(directory: Path, seed: int = 0, **config: Any) -> Any:
    """Save a randomized tiny V4 model to ``directory``; returns the transformers model (eval, float32)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(tiny_v4_config(**config)).eval()
    randomize(model, seed)
    model.save_pretrained(directory)
    return model


def load_ours(directory: Path, fp8: str = "dequantize", packed: bool = False) -> CausalLM:
    """Our model from an HF folder on the CPU, without a tokenizer (``load_model`` needs one); ``fp8``
    is the ``AGENT_INFER_FP8_WEIGHTS`` policy for an FP8 checkpoint (keep: FP8 projections); with
    ``packed`` on the packed-float kernels ``load_model`` picks on the CPU."""
    from agent_infer.model.layers.float_linear import pack_loaded, packed_float_kernels

    kernels, kept = hf_kernels(directory, torch.device("cpu"), torch.float32, fp8)
    if packed and kept is None:
        kernels = packed_float_kernels()
    model = build_model(hf_config(directory), kernels=kernels)
    model.load_weights(hf_weights(directory, frozenset(kept.kept) if kept is not None else frozenset()))
    if packed and kept is None:
        pack_loaded(model)
    return model.eval()


def write_tokenizer(directory: Path) -> int:
    """Write the default model's (SmolLM2) tokenizer into an HF folder; returns its vocabulary size."""
    tok = Tokenizer.from_gguf_metadata(GGUFFile(default_model_path()).metadata)
    tok.hf_tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": tok.chat_template})
    )
    return tok.vocab_size


class ReferenceMTP(torch.nn.Module):
    """One MTP module in plain torch after DeepSeek's description, over transformers' decoder block:
    ``head(norm(Block(eh_proj([enorm(embed(t_next)) ; hnorm(h)]))))`` on whole sequences, no cache."""

    def __init__(self, cfg: Any, index: int) -> None:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = hf.DeepseekV3RMSNorm(h, eps)
        self.hnorm = hf.DeepseekV3RMSNorm(h, eps)
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        self.block = hf.DeepseekV3DecoderLayer(cfg, index)
        self.shared_head = torch.nn.Module()
        self.shared_head.norm = hf.DeepseekV3RMSNorm(h, eps)
        self.shared_head.head = torch.nn.Linear(h, cfg.vocab_size, bias=False)
        self.embed_tokens = torch.nn.Embedding(cfg.vocab_size, h)
        self.index = index

    def forward(
        self, hidden: torch.Tensor, next_tokens: torch.Tensor, rotary: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h', logits)`` ``[T, ...]`` for hidden states ``[T, hidden]`` at positions ``0..T-1`` and the
        tokens that follow each position (``[T]``); with a leading batch dimension, per row."""
        single = hidden.dim() == 2
        if single:
            hidden, next_tokens = hidden[None], next_tokens[None]
        t = int(hidden.shape[1])
        e = self.enorm(self.embed_tokens(next_tokens))
        x = self.eh_proj(torch.cat((e, self.hnorm(hidden)), dim=-1))
        pos = torch.arange(t)[None].expand(int(x.shape[0]), t)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = self.block(x, attention_mask=mask, position_ids=pos, position_embeddings=rotary(x, pos))
        h2 = out[0] if isinstance(out, tuple) else out
        if single:
            h2 = h2[0]
        return h2, self.shared_head.head(self.shared_head.norm(h2))

    def checkpoint_tensors(self, with_embed_and_head: bool = True) -> dict[str, torch.Tensor]:
        """The module's tensors under DeepSeek's released names."""
        out = {}
        prefix = f"model.layers.{self.index}."
        for name, p in self.state_dict().items():
            if not with_embed_and_head and name in ("embed_tokens.weight", "shared_head.head.weight"):
                continue
            key = prefix + name.removeprefix("block.")
            if name.endswith("experts.gate_up_proj"):  # transformers' fused experts -> DeepSeek's names
                inter = p.shape[1] // 2
                for e in range(p.shape[0]):
                    out[key[: -len("gate_up_proj")] + f"{e}.gate_proj.weight"] = p[e, :inter].clone()
                    out[key[: -len("gate_up_proj")] + f"{e}.up_proj.weight"] = p[e, inter:].clone()
            elif name.endswith("experts.down_proj"):
                for e in range(p.shape[0]):
                    out[key[: -len("down_proj")] + f"{e}.down_proj.weight"] = p[e].clone()
            else:
                out[key] = p.detach().clone().contiguous()
        return out


def save_tiny_mtp(
    directory: Path,
    seed: int = 0,
    with_embed_and_head: bool = True,
    predictable: bool = False,
    depth: int = 1,
    **config: Any,
) -> tuple[Any, ReferenceMTP]:
    """:func:`save_tiny` plus ``depth`` MTP modules (random, unit scale; see :func:`make_predictable`)
    stored under DeepSeek's names; returns the transformers model and the first reference module
    (the others are :func:`reference_modules` of the folder)."""
    from safetensors.torch import load_file, save_file

    hf = save_tiny(directory, seed, num_nextn_predict_layers=depth, **config)
    cfg = hf.config
    cfg._attn_implementation = "eager"
    refs = []
    for d in range(depth):
        ref = ReferenceMTP(cfg, cfg.num_hidden_layers + d).eval()
        randomize(ref, seed + 1 + d)
        if predictable:
            make_predictable(hf, ref, main=d == 0)
        if not with_embed_and_head:
            with torch.no_grad():
                ref.embed_tokens.weight.copy_(hf.model.embed_tokens.weight)
                ref.shared_head.head.weight.copy_(hf.lm_head.weight)
        refs.append(ref)
    if predictable:
        hf.save_pretrained(directory)
    files = sorted(directory.glob("*.safetensors"))
    assert len(files) == 1
    tensors = load_file(str(files[0]))
    for ref in refs:
        tensors.update(ref.checkpoint_tensors(with_embed_and_head))
    save_file(tensors, str(files[0]), metadata={"format": "pt"})
    return hf, refs[0]


BYTE_VOCAB = 258  # 256 byte tokens, <|endoftext|> (256) and <|pad|> (257)


def write_byte_tokenizer(directory: Path) -> int:
    """Write a byte-level tokenizer of :data:`BYTE_VOCAB` tokens (no merges) into an HF folder, so a
    tiny model with a small vocabulary can run in the engine; returns the EOS id."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=lambda c: _byte_of(c)))}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|pad|>"])
    tok.save(str(directory / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": template})
    )
    return 256


def _byte_of(ch: str) -> int:
    """The byte GPT-2's byte-level alphabet maps to ``ch``."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(map(chr, cs), bs))[ch]


def make_predictable(hf: Any, ref: ReferenceMTP, scale: float = 0.05, main: bool = True) -> None:
    """Shrink every block's output (attention ``o_proj``, MLP and expert ``down_proj``) by ``scale``
    in the main model and the MTP module, and make the module's ``eh_proj`` pass the token's
    embedding through: the main model then mostly predicts the next token from the current one,
    and the module (same embedding and head) predicts the token after the one it is given. Its
    drafts are then accepted often but not always (the shrunk blocks still shift some arg-maxes),
    which exercises both sides of verification without training. ``main`` False leaves ``hf`` as
    it is (a further module of a model already made predictable)."""
    h = hf.config.hidden_size
    with torch.no_grad():
        for module in (hf, ref) if main else (ref,):
            for name, p in module.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj.weight", "down_proj")):
                    p.mul_(scale)
        if main:
            hf.lm_head.weight.mul_(4.0)  # sharper distributions: the confidence schedule has drafts to keep
        ref.embed_tokens.weight.copy_(hf.model.embed_tokens.weight)
        ref.shared_head.head.weight.copy_(hf.lm_head.weight)
        ref.eh_proj.weight.zero_()
        ref.eh_proj.weight[:, :h].copy_(torch.eye(h))
        ref.enorm.weight.copy_(hf.model.norm.weight)
        ref.shared_head.norm.weight.fill_(1.0)


def rewrite_config(directory: Path, **changes: Any) -> None:
    """Set keys of a folder's ``config.json`` (None: remove the key)."""
    cfg = json.loads((directory / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (directory / "config.json").write_text(json.dumps(cfg))


def edit_tensors(directory: Path, edit: Callable[[dict[str, torch.Tensor]], Any]) -> None:
    """Apply ``edit`` to the tensors of a single-file folder's ``model.safetensors`` and write them back."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(directory / "model.safetensors")
    edit(tensors)
    save_file(tensors, directory / "model.safetensors")


def _random_prompt(seed: int, length: int) -> list[int]:
    return torch.randint(2, 256, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_alone_equals_mixed_batch(model: CausalLM) -> None:
    """A request's logits over a prefill and 6 decode steps are bit-identical alone and in a batch of
    8 (others prefilling whole, in chunks, or decoding when it arrives)."""
    prompt = _random_prompt(7, 21)
    alone = SequenceRunner(model, num_blocks=64, block_size=8)
    want = [alone.step([(0, prompt)])[0]]
    tokens = list(prompt)
    for _ in range(6):
        tokens.append(int(want[-1].argmax()))
        want.append(alone.step([(0, [tokens[-1]])])[0])
    batch = SequenceRunner(model, num_blocks=64, block_size=8)
    others = {i: _random_prompt(100 + i, 9 + 5 * i) for i in range(1, 8)}
    for i in range(1, 8, 2):  # half the others are already decoding when ours arrives
        batch.step([(i, others[i])])
    for step in range(7):
        items = [(0, prompt if step == 0 else [tokens[len(prompt) + step - 1]])]
        for i in range(1, 8):
            if i % 2 or step:
                items.append((i, [int(t) % 200 + 2 for t in others[i][step : step + 1 + (i % 3)]]))
            else:
                items.append((i, others[i]))
        got = batch.step(items)[0]
        assert torch.equal(got, want[step]), f"step {step}"
