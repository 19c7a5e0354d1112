"""Hugging Face directories: ``config.json`` + ``*.safetensors`` (single or sharded) + tokenizer files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from agent_infer.errors import ModelLoadError, UnsupportedModelError
from agent_infer.model.config import ModelConfig, MoESpec
from agent_infer.model.loading.quantized import (
    QuantFormat,
    Rename,
    checkpoint_weights,
    fp8_weight_names,
    quant_format,
)
from agent_infer.model.registry import hf_architecture


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: cannot read JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return data


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _architecture_name(cfg: dict[str, Any]) -> str:
    """The first ``architectures`` entry, or ``model_type`` without one."""
    names = cfg.get("architectures")
    return str(names[0]) if isinstance(names, list) and names else str(cfg.get("model_type", ""))


def hf_config(directory: str | Path) -> ModelConfig:
    """Build a :class:`ModelConfig` from ``config.json`` (and ``generation_config.json`` for EOS ids).

    The architecture is the first ``architectures`` entry (``model_type`` without one), resolved by
    the registry; an architecture with fields of its own (latent attention, experts) reads them
    through its registry entry. A ``quantization_config`` other than DeepSeek's block FP8 is an error.
    """
    d = Path(directory)
    cfg = _read_json(d / "config.json")
    name = _architecture_name(cfg)
    found = hf_architecture(name, f"{d}: ")
    if found.hf_text_config is not None:
        cfg = found.hf_text_config(cfg)
    arch = found.name
    if not found.qkv_bias and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise UnsupportedModelError(
            f"{d}: {name} with attention_bias/mlp_bias (o_proj/MLP biases) is not supported"
        )
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        # transformers 5 moved rope settings into `rope_parameters`; older configs have rope_theta/rope_scaling
        rope = cfg.get("rope_parameters") or {}
        theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        # a family with its own config fields (Gemma's per-layer windows) reads its windows itself
        window = _sliding_window(cfg, d) if found.hf_fields is None else None
        moe = _moe(cfg, d)
        eos = _ids(cfg.get("eos_token_id"))
        gen_path = d / "generation_config.json"
        if gen_path.is_file():
            eos += [i for i in _ids(_read_json(gen_path).get("eos_token_id")) if i not in eos]
        fields: dict[str, Any] = dict(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rope_theta=theta,
            rope_scaling=dict(scaling) if scaling else None,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=found.qkv_bias,
            bos_token_id=cfg.get("bos_token_id") if isinstance(cfg.get("bos_token_id"), int) else None,
            eos_token_ids=tuple(eos),
            sliding_window=window,
            moe=moe,
        )
        quant_format(cfg, f"{d / 'config.json'}: ")
        if found.hf_fields is not None:
            fields.update(found.hf_fields(cfg, f"{d / 'config.json'}: "))
        return ModelConfig(**fields)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{d / 'config.json'}: missing or invalid field: {exc}") from exc


def _moe(cfg: dict[str, Any], d: Path) -> MoESpec | None:
    """The experts of a Qwen-MoE style config (``num_experts`` > 0), or None for a dense model."""
    # transformers 5 writes the hub's `num_experts` as `num_local_experts`
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        return None
    if int(cfg.get("decoder_sparse_step", 1)) != 1 or cfg.get("mlp_only_layers"):
        raise UnsupportedModelError(
            f"{d}: dense layers among MoE layers (decoder_sparse_step/mlp_only_layers) are not supported"
        )
    if cfg.get("shared_expert_intermediate_size"):
        raise UnsupportedModelError(
            f"{d}: shared experts (shared_expert_intermediate_size) are not supported"
        )
    return MoESpec(
        num_experts=int(experts),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        renormalize=bool(cfg.get("norm_topk_prob", False)),
    )


def _sliding_window(cfg: dict[str, Any], d: Path) -> int | None:
    """The one window every layer uses, or None; per-layer windows raise naming the key."""
    if cfg.get("use_sliding_window") is False:  # Qwen: a window is configured but switched off
        return None
    if cfg.get("use_sliding_window") is True:
        raise UnsupportedModelError(
            f"{d}: use_sliding_window=true (windows on the layers past max_window_layers) is not supported"
        )
    window = cfg.get("sliding_window")
    kinds = set(cfg.get("layer_types") or ())
    if window is None or kinds == {"full_attention"}:
        return None
    if kinds - {"sliding_attention"}:
        raise UnsupportedModelError(f"{d}: layer_types mixing {sorted(kinds)} are not supported")
    return int(window)


def safetensors_files(directory: str | Path) -> list[Path]:
    """The weight files of an HF directory, via the shard index when there is one."""
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(f"{index}: no weight_map")
        files = [d / name for name in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{index}: shard {f.name} is missing")
        return files
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{d}: no *.safetensors weights (PyTorch .bin checkpoints are not supported)")
    return files


def _layout(directory: str | Path) -> tuple[QuantFormat | None, Rename | None]:
    """The quantization and the tensor naming of an HF folder's checkpoint, from its ``config.json``
    (none of either without one, or for an architecture the registry does not know)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return None, None
    cfg = _read_json(path)
    fmt = quant_format(cfg, f"{path}: ")
    try:
        found = hf_architecture(_architecture_name(cfg))
    except UnsupportedModelError:
        return fmt, None
    return fmt, found.hf_tensor_name


def hf_weights(
    directory: str | Path, keep_fp8: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from every safetensors shard (memory-mapped) under the family's names
    (a checkpoint in another naming, DeepSeek's released V4 layout, is renamed by its architecture);
    quantized weights come dequantized to float32 but for the FP8 ones named in ``keep_fp8``
    (see loading/quantized.py)."""
    fmt, rename = _layout(directory)
    yield from checkpoint_weights(safetensors_files(directory), fmt, rename, keep_fp8)


def hf_quant_format(directory: str | Path) -> QuantFormat | None:
    """The quantization an HF folder's ``config.json`` declares (None: none, or no ``config.json``)."""
    return _layout(directory)[0]


def hf_fp8_weight_names(directory: str | Path) -> frozenset[str]:
    """The family's names of the weights an HF folder stores in block FP8 (headers only)."""
    fmt, rename = _layout(directory)
    if fmt is None or fmt.block is None:
        return frozenset()
    return fp8_weight_names(safetensors_files(directory), rename)
