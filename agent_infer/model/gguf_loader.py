"""GGUF models: config from metadata, weights dequantized in torch and renamed to HF names.

llama.cpp's converter permutes the rows of Llama q/k projections for its interleaved RoPE; we undo
that here so the model's single HF "rotate_half" RoPE serves GGUF and safetensors alike.
"""

from __future__ import annotations

import re
from collections.abc import Container, Iterator
from pathlib import Path
from typing import Any

import torch

from agent_infer.errors import ModelLoadError, UnsupportedModelError
from agent_infer.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from agent_infer.model.gguf_reader import GGUFFile

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


def _req(meta: dict[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise ModelLoadError(f"{path}: GGUF metadata lacks required key {key!r}")
    return meta[key]


def gguf_config(f: GGUFFile) -> ModelConfig:
    """Build a :class:`ModelConfig` from a GGUF file's metadata."""
    meta, path = f.metadata, f.path
    arch = str(meta.get("general.architecture", ""))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    hidden = int(_req(meta, f"{arch}.embedding_length", path))
    heads = int(_req(meta, f"{arch}.attention.head_count", path))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(
        meta.get(f"{arch}.attention.key_length", meta.get(f"{arch}.rope.dimension_count", hidden // heads))
    )
    if "rope_freqs.weight" in f.tensors:
        raise UnsupportedModelError(
            f"{path}: per-dimension RoPE frequency factors (rope_freqs.weight) are not supported"
        )
    scaling_type = str(meta.get(f"{arch}.rope.scaling.type", "none"))
    rope_scaling: dict[str, Any] | None = None
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    elif scaling_type != "none":
        raise UnsupportedModelError(f"{path}: unsupported RoPE scaling type {scaling_type!r}")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(meta.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    if vocab <= 0:
        raise ModelLoadError(f"{path}: cannot determine the vocabulary size")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(_req(meta, f"{arch}.feed_forward_length", path)),
        num_layers=int(_req(meta, f"{arch}.block_count", path)),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rms_norm_eps=float(_req(meta, f"{arch}.attention.layer_norm_rms_epsilon", path)),
        max_position_embeddings=int(_req(meta, f"{arch}.context_length", path)),
        tie_word_embeddings="output.weight" not in f.tensors,
        attention_bias="blk.0.attn_q.bias" in f.tensors,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor, or None when it has no HF counterpart."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _unpermute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # inverse of llama.cpp's permute(): per head, rows were reordered from [half0 | half1] to interleaved pairs
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_weights(
    f: GGUFFile, config: ModelConfig, skip: Container[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every tensor whose HF name is not in ``skip``.

    Unknown names raise ModelLoadError; skipped tensors (packed for the native kernel) are never dequantized.
    """
    for name in f.tensors:
        target = hf_name(name)
        if target is None:
            raise ModelLoadError(
                f"{f.path}: unexpected tensor {name!r} for a {config.architecture} GGUF model"
            )
        if target in skip:
            continue
        w = f.dequantize(name)
        if config.architecture == "llama":
            if target.endswith("q_proj.weight"):
                w = _unpermute(w, config.num_heads)
            elif target.endswith("k_proj.weight"):
                w = _unpermute(w, config.num_kv_heads)
        yield target, w
