"""GGUF models: config from metadata, tensors renamed to HF names by the family's table, and either
dequantized in torch or packed for the native kernel (:class:`PackedLinears`).

llama.cpp's converter permutes the rows of Llama q/k projections for its interleaved RoPE; both
routes undo that, so the model's single HF "rotate_half" RoPE serves GGUF and safetensors alike.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Container, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from agent_infer import envs
from agent_infer.errors import ModelLoadError, UnsupportedModelError
from agent_infer.model.config import ModelConfig, MoESpec
from agent_infer.model.layers.linear import Linear, WeightPart
from agent_infer.model.layers.qlinear import F32, NATIVE_TYPES, QuantLinear
from agent_infer.model.loading.gguf_reader import GGUFFile
from agent_infer.model.loading.gguf_transcode import Q8_0, Q8_COMPATIBLE, to_q8_0
from agent_infer.model.registry import Architecture, architecture, gguf_architecture

#: Tensors that are part of the config (read by :func:`gguf_config`), not weights.
_CONFIG_TENSORS = frozenset({"rope_freqs.weight"})
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _req(meta: dict[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise ModelLoadError(f"{path}: GGUF metadata lacks required key {key!r}")
    return meta[key]


def gguf_config(f: GGUFFile) -> ModelConfig:
    """Build a :class:`ModelConfig` from a GGUF file's metadata."""
    meta, path = f.metadata, f.path
    arch = gguf_architecture(str(meta.get("general.architecture", "")), f"{path}: ").name
    hidden = int(_req(meta, f"{arch}.embedding_length", path))
    heads = int(_req(meta, f"{arch}.attention.head_count", path))
    kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(
        meta.get(f"{arch}.attention.key_length", meta.get(f"{arch}.rope.dimension_count", hidden // heads))
    )
    freq_factors = None
    if "rope_freqs.weight" in f.tensors:
        # llama.cpp's form of Llama 3.1+ RoPE scaling: the per-pair divisors, precomputed
        freq_factors = tuple(float(v) for v in f.dequantize("rope_freqs.weight").reshape(-1).tolist())
    scaling_key = f"{arch}.rope.scaling.type"
    scaling_type = str(meta.get(scaling_key, "none"))
    rope_scaling: dict[str, Any] | None = None
    if scaling_type == "linear":
        rope_scaling = {
            "rope_type": "linear",
            "factor": float(_req(meta, f"{arch}.rope.scaling.factor", path)),
        }
    elif scaling_type != "none":
        raise UnsupportedModelError(f"{path}: unsupported {scaling_key} {scaling_type!r} (supported: linear)")
    window = meta.get(f"{arch}.attention.sliding_window")
    moe = None
    if f"{arch}.expert_count" in meta:
        # llama.cpp renormalizes the chosen experts' weights of Qwen 3 MoE unconditionally
        moe = MoESpec(
            num_experts=int(meta[f"{arch}.expert_count"]),
            top_k=int(_req(meta, f"{arch}.expert_used_count", path)),
            intermediate_size=int(_req(meta, f"{arch}.expert_feed_forward_length", path)),
            renormalize=bool(meta.get(f"{arch}.expert_weights_norm", True)),
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(meta.get(f"{arch}.vocab_size", len(tokens) if tokens is not None else 0))
    if vocab <= 0:
        raise ModelLoadError(f"{path}: cannot determine the vocabulary size")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    bos = meta.get("tokenizer.ggml.bos_token_id")
    config = ModelConfig(
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
        sliding_window=None if window is None else int(window),
        rope_freq_factors=freq_factors,
        moe=moe,
    )
    found = gguf_architecture(arch)
    if found.gguf_options is not None:
        config = dataclasses.replace(config, **found.gguf_options(meta, config))
    return config


def hf_name(arch: Architecture, gguf_name: str) -> str | None:
    """The HF name of a GGUF tensor of ``arch``, or None when it has no HF counterpart."""
    if gguf_name in arch.gguf_global_names:
        return arch.gguf_global_names[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m and m.group(2) in arch.gguf_layer_names:
        return f"model.layers.{m.group(1)}.{arch.gguf_layer_names[m.group(2)]}"
    return None


def gguf_name(arch: Architecture, hf: str) -> str:
    """The GGUF name of HF tensor ``hf`` of ``arch`` (the inverse of :func:`hf_name`)."""
    for g, h in arch.gguf_global_names.items():
        if h == hf:
            return g
    m = _HF_LAYER_RE.fullmatch(hf)
    if m:
        for g, h in arch.gguf_layer_names.items():
            if h == m.group(2):
                return f"blk.{m.group(1)}.{g}"
    raise ModelLoadError(f"no GGUF name for tensor {hf!r} of a {arch.name} model")


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
    arch = architecture(config.architecture)
    for name in f.tensors:
        if name in _CONFIG_TENSORS:
            continue
        m = _LAYER_RE.fullmatch(name)
        if m and m.group(2) in arch.gguf_expert_names:
            yield from _expert_slices(
                f, name, f"model.layers.{m.group(1)}.{arch.gguf_expert_names[m.group(2)]}", skip
            )
            continue
        target = hf_name(arch, name)
        if target is None:
            raise ModelLoadError(
                f"{f.path}: unexpected tensor {name!r} for a {config.architecture} GGUF model"
            )
        if target in skip:
            continue
        w = f.dequantize(name)
        if arch.gguf_permutes_qk:
            if target.endswith("q_proj.weight"):
                w = _unpermute(w, config.num_heads)
            elif target.endswith("k_proj.weight"):
                w = _unpermute(w, config.num_kv_heads)
        yield target, w


def _expert_slices(
    f: GGUFFile, name: str, pattern: str, skip: Container[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Expert ``e``'s slice of the stacked 3-D tensor ``name`` under HF name ``pattern.format(e=e)``."""
    names = [pattern.format(e=e) for e in range(f.tensors[name].shape[0])]
    if all(n in skip for n in names):
        return
    for hf, w in zip(names, f.dequantize(name), strict=True):
        if hf not in skip:
            yield hf, w


def gguf_rows(
    f: GGUFFile, name: str, permute_heads: int | None = None, *, force_f32: bool = False
) -> tuple[torch.Tensor, int, int]:
    """Raw bytes of 2-D GGUF tensor ``name`` as ``[rows, row_bytes]`` (q/k rows un-permuted for RoPE).

    Returns ``(bytes, ggml_type, rows)``; types the kernel cannot read (or all, with ``force_f32``) are
    dequantized to float32 bytes first, which is exact.
    """
    info = f.tensors[name]
    if len(info.shape) != 2:
        raise ModelLoadError(f"{f.path}: tensor {name!r} has shape {info.shape}, expected 2-D")
    rows = info.shape[0]
    if info.ggml_type in NATIVE_TYPES and not force_f32:
        raw, typ = f.raw(info).view(rows, -1), info.ggml_type
    else:
        raw, typ = f.dequantize(name).contiguous().view(torch.uint8).view(rows, -1), F32
    if permute_heads is not None:
        # llama.cpp interleaved each head's two RoPE halves; whole rows move, so blocks stay intact
        raw = raw.reshape(permute_heads, rows // permute_heads // 2, 2, -1).transpose(1, 2).reshape(rows, -1)
    return raw, typ, rows


class PackedLinears:
    """Builds :class:`QuantLinear` layers straight from a GGUF file's quantized bytes.

    A fused projection whose parts have different ggml types is packed as Q8_0 when every part is
    Q4_0/Q5_0/Q8_0 (re-encoded exactly), else from exact float32 values.
    Activations are quantized to int8 per ``AGENT_INFER_LINEAR_ACTIVATIONS`` (read once, here).
    """

    def __init__(self, f: GGUFFile, arch: Architecture) -> None:
        self.file = f
        self.arch = arch
        self.q8 = envs.linear_activations() == "q8"

    def _tensor(self, hf: str) -> str:
        name = gguf_name(self.arch, hf)
        if name not in self.file.tensors:
            raise ModelLoadError(f"{self.file.path}: missing tensors: {hf} (GGUF {name!r})")
        return name

    def linear(self, parts: Sequence[WeightPart], in_features: int, *, bias: bool = False) -> Linear:
        """One packed projection of ``parts`` (stacked along N) with an optional bias loaded by name."""
        f = self.file
        names = [self._tensor(p.name) for p in parts]
        types = {f.tensors[n].ggml_type for n in names}
        mixed = len(types) > 1
        # mixed 32-value types (Q5_0 q/k with a Q8_0 v) stay packed as Q8_0; others widen to float32
        as_q8_0 = mixed and types <= Q8_COMPATIBLE
        blocks = []
        for part, name in zip(parts, names):
            permute = part.rope_heads if self.arch.gguf_permutes_qk else None
            block = gguf_rows(f, name, permute, force_f32=mixed and not as_q8_0)
            if as_q8_0:
                block = (to_q8_0(block[0], block[1]), Q8_0, block[2])
            shape = f.tensors[name].shape
            if shape[-1] != in_features or block[2] != part.rows:
                raise ModelLoadError(
                    f"{f.path}: tensor {name!r} has shape {shape}, expected {(part.rows, in_features)}"
                )
            blocks.append(block)
        return QuantLinear.from_rows(blocks, in_features, q8_activations=self.q8, parts=parts, bias=bias)

    def head(self, name: str, rows: int, in_features: int, *, tied: nn.Parameter | None) -> Linear:
        """The packed LM head: the file's output matrix, or its embedding when it has none."""
        f = self.file
        own = gguf_name(self.arch, name)
        source = own if own in f.tensors else self._tensor("model.embed_tokens.weight")
        if f.tensors[source].shape != (rows, in_features):
            raise ModelLoadError(
                f"{f.path}: tensor {source!r} has shape {f.tensors[source].shape}, expected {(rows, in_features)}"
            )
        return QuantLinear.from_rows(
            [gguf_rows(f, source)], in_features, q8_activations=self.q8, parts=[WeightPart(name, rows)]
        )
