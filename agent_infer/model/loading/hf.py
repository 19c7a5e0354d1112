"""Hugging Face directories: ``config.json`` + ``*.safetensors`` (single or sharded) + tokenizer files."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from agent_infer.errors import ModelLoadError, UnsupportedModelError
from agent_infer.model.config import ModelConfig
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


def hf_config(directory: str | Path) -> ModelConfig:
    """Build a :class:`ModelConfig` from ``config.json`` (and ``generation_config.json`` for EOS ids).

    The architecture is the first ``architectures`` entry (``model_type`` without one), resolved by
    the registry.
    """
    d = Path(directory)
    cfg = _read_json(d / "config.json")
    names = cfg.get("architectures")
    name = str(names[0]) if isinstance(names, list) and names else str(cfg.get("model_type", ""))
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
        eos = _ids(cfg.get("eos_token_id"))
        gen_path = d / "generation_config.json"
        if gen_path.is_file():
            eos += [i for i in _ids(_read_json(gen_path).get("eos_token_id")) if i not in eos]
        config = ModelConfig(
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
        )
        if found.hf_options is not None:
            config = dataclasses.replace(config, **found.hf_options(cfg))
        return config
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{d / 'config.json'}: missing or invalid field: {exc}") from exc


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


def hf_weights(directory: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from every safetensors shard (memory-mapped)."""
    for path in safetensors_files(directory):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as exc:
            raise ModelLoadError(f"{path}: corrupt or unreadable safetensors file: {exc}") from exc
