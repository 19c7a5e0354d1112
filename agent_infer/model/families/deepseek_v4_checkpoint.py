"""A DeepSeek V4 checkpoint: its ``config.json`` (as transformers' ``DeepseekV4Config`` writes it, or as
DeepSeek releases it) read into our config, and the tensor names of DeepSeek's released files.

Values this engine does not implement raise :class:`ModelLoadError` naming the key. Absent keys take
transformers' defaults (``layer_types``: two heavily compressed layers, then sparse and heavy
alternating; ``mlp_layer_types``: three hash-routed layers, then top-k routed), and the release's
spellings (``compress_ratios``, ``compress_rate_csa``/``_hca``, ``num_hash_layers``,
``qk_rope_head_dim``) are read as transformers reads them.

The family loads the names ``DeepseekV4ForCausalLM.save_pretrained`` writes (``model.layers.{i}.attn.
wq_a.weight``, ``model.embed_tokens.weight``, ``head.weight``). DeepSeek's released files name the
same tensors without the ``model.`` prefix and spell a few differently; :func:`hf_tensor_name` maps
them (the table is :data:`RELEASED_GLOBAL_NAMES` plus ``attn.kv_norm`` -> ``attn.norm`` inside a
block). Their quantization (FP8 projections with ``.scale`` tensors, FP4 routed experts) is read by
loading/quantized.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent_infer.errors import ModelLoadError
from agent_infer.model.config import DeepseekV4Spec, MoESpec, rope_scaling_type

#: Tensors outside the blocks: DeepSeek's released name -> the family's.
RELEASED_GLOBAL_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}

_SCORING = ("sqrtsoftplus", "softmax", "sigmoid")
_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")
_MLP_TYPES = ("hash_moe", "moe")
_RATIO_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def hf_tensor_name(name: str) -> str:
    """The family's name of a tensor of DeepSeek's released V4 files (``layers.{i}.*`` gain the
    ``model.`` prefix, the attention's ``kv_norm`` is ``norm``); other names, the family's own, the
    head's and the MTP layers' ``mtp.*`` (loaded by the MTP module), come back unchanged."""
    found = RELEASED_GLOBAL_NAMES.get(name)
    if found is not None:
        return found
    if name.startswith("layers."):
        return "model." + name.replace(".attn.kv_norm.", ".attn.norm.", 1)
    return name


def _int(cfg: Mapping[str, Any], key: str, where: str, default: int | None = None, low: int = 1) -> int:
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ModelLoadError(f"{where}{key} must be an integer >= {low}, got {value!r}")
    return value


def _float(cfg: Mapping[str, Any], key: str, where: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelLoadError(f"{where}{key} must be a number, got {value!r}")
    return float(value)


def hf_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config with ``intermediate_size`` (the common reader's key) set to the experts' width."""
    out = dict(cfg)
    if "intermediate_size" not in out and "moe_intermediate_size" in out:
        out["intermediate_size"] = out["moe_intermediate_size"]
    return out


def _layer_types(cfg: Mapping[str, Any], n: int, where: str) -> list[str]:
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        ratios = cfg["compress_ratios"]
        if not isinstance(ratios, list) or any(r not in _RATIO_TYPES for r in ratios):
            raise ModelLoadError(
                f"{where}compress_ratios must list values in {sorted(_RATIO_TYPES)}, got {ratios!r}"
            )
        types = [_RATIO_TYPES[r] for r in ratios]
    if types is None:
        tail = [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
            for i in range(max(n - 2, 0))
        ]
        types = ["heavily_compressed_attention"] * min(n, 2) + tail
    if not isinstance(types, list) or len(types) < n:
        raise ModelLoadError(f"{where}layer_types must list {n} layer types, got {types!r}")
    for i, t in enumerate(types[:n]):
        if t not in _LAYER_TYPES:
            raise ModelLoadError(f"{where}layer_types[{i}] = {t!r}; supported: {', '.join(_LAYER_TYPES)}")
    return list(types[:n])


def _mlp_types(cfg: Mapping[str, Any], n: int, where: str) -> list[str]:
    types = cfg.get("mlp_layer_types")
    if types is None:
        hashed = _int(cfg, "num_hash_layers", where, 3, low=0)
        types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    if not isinstance(types, list) or len(types) < n:
        raise ModelLoadError(f"{where}mlp_layer_types must list {n} MLP types, got {types!r}")
    for i, t in enumerate(types[:n]):
        if t not in _MLP_TYPES:
            raise ModelLoadError(f"{where}mlp_layer_types[{i}] = {t!r}; supported: {', '.join(_MLP_TYPES)}")
    return list(types[:n])


def _rates(cfg: Mapping[str, Any], types: list[str], where: str) -> tuple[int, ...]:
    rates = dict(cfg.get("compress_rates") or {})
    defaults = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    for legacy, kind in (
        ("compress_rate_csa", "compressed_sparse_attention"),
        ("compress_rate_hca", "heavily_compressed_attention"),
    ):
        if cfg.get(legacy) is not None:
            rates[kind] = cfg[legacy]
    out = []
    for t in types:
        if t == "sliding_attention":
            out.append(0)
            continue
        out.append(_int({"r": rates.get(t, defaults[t])}, "r", f"{where}compress_rates[{t!r}] ", low=1))
    return tuple(out)


def _compress_rope(cfg: Mapping[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """The compressed layers' RoPE base and scaling (None: plain RoPE)."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise ModelLoadError(f"{where}rope_parameters must be an object, got {rp!r}")
    main = rp.get("main")
    if isinstance(main, dict) and rope_scaling_type(main) != "default":
        raise ModelLoadError(
            f"{where}rope_parameters.main must be plain RoPE, got {rope_scaling_type(main)!r}"
        )
    nested = rp.get("compress")
    compress: dict[str, Any] = (
        nested if isinstance(nested, dict) else {k: v for k, v in rp.items() if k not in ("main", "compress")}
    )
    theta = float(compress.get("rope_theta", _float(cfg, "compress_rope_theta", where, 160000.0)))
    kind = rope_scaling_type(compress)
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise ModelLoadError(f"{where}unsupported compressed-layer rope type {kind!r}; supported: yarn")
    for key in ("factor", "original_max_position_embeddings"):
        if compress.get(key) is None:
            raise ModelLoadError(f"{where}rope_parameters.compress lacks {key!r}")
    return theta, {**compress, "rope_type": "yarn"}


def _main_theta(cfg: Mapping[str, Any], where: str) -> float:
    rp = cfg.get("rope_parameters") or {}
    main = rp.get("main") if isinstance(rp, dict) else None
    if isinstance(main, dict) and main.get("rope_theta") is not None:
        return _float(main, "rope_theta", f"{where}rope_parameters.main.", 10000.0)
    return _float(cfg, "rope_theta", where, 10000.0)


def hf_config_fields(cfg: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """The DeepSeek V4 fields of ``config.json`` as :class:`ModelConfig` keyword arguments."""
    for key, allowed, default in (
        ("scoring_func", _SCORING, "sqrtsoftplus"),
        ("hidden_act", ("silu",), "silu"),
    ):
        if cfg.get(key, default) not in allowed:
            raise ModelLoadError(
                f"{where}unsupported {key} {cfg.get(key)!r}; supported: {', '.join(allowed)}"
            )
    n = _int(cfg, "num_hidden_layers", where)
    heads = _int(cfg, "num_attention_heads", where)
    head_dim = _int(cfg, "head_dim", where, 512)
    if cfg.get("num_key_value_heads", 1) != 1:
        raise ModelLoadError(
            f"{where}num_key_value_heads must be 1 (one shared K=V head), got {cfg.get('num_key_value_heads')!r}"
        )
    if cfg.get("qk_rope_head_dim") is not None:
        rope_dim = _int(cfg, "qk_rope_head_dim", where)
    else:
        factor = _float(cfg, "partial_rotary_factor", where, 64 / 512)
        rope_dim = int(head_dim * factor)
    index_dim = _int(cfg, "index_head_dim", where, 128)
    if rope_dim % 2 or rope_dim > head_dim or rope_dim > index_dim:
        raise ModelLoadError(
            f"{where}qk_rope_head_dim={rope_dim} must be even and at most head_dim={head_dim} and index_head_dim={index_dim}"
        )
    groups = _int(cfg, "o_groups", where, 8)
    if (heads * head_dim) % groups:
        raise ModelLoadError(f"{where}o_groups={groups} does not divide num_attention_heads * head_dim")
    types = _layer_types(cfg, n, where)
    mlp_types = _mlp_types(cfg, n, where)
    theta, scaling = _compress_rope(cfg, where)
    if _int(cfg, "n_shared_experts", where, 1, low=0) != 1:
        raise ModelLoadError(
            f"{where}n_shared_experts must be 1 (DeepSeek V4 has one shared expert), got {cfg.get('n_shared_experts')!r}"
        )
    limit = cfg.get("swiglu_limit", 10.0)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or limit <= 0):
        raise ModelLoadError(f"{where}swiglu_limit must be a positive number or null, got {limit!r}")
    spec = DeepseekV4Spec(
        q_lora_rank=_int(cfg, "q_lora_rank", where, 1024),
        qk_rope_head_dim=rope_dim,
        o_groups=groups,
        o_lora_rank=_int(cfg, "o_lora_rank", where, 1024),
        sliding_window=_int(cfg, "sliding_window", where, 128),
        compress_rates=_rates(cfg, types, where),
        sparse=tuple(t == "compressed_sparse_attention" for t in types),
        hash_layers=tuple(t == "hash_moe" for t in mlp_types),
        index_n_heads=_int(cfg, "index_n_heads", where, 64),
        index_head_dim=index_dim,
        index_topk=_int(cfg, "index_topk", where, 512),
        hc_mult=_int(cfg, "hc_mult", where, 4),
        hc_sinkhorn_iters=_int(cfg, "hc_sinkhorn_iters", where, 20),
        hc_eps=_float(cfg, "hc_eps", where, 1e-6),
        compress_rope_theta=theta,
        compress_rope_scaling=scaling,
        swiglu_limit=None if limit is None else float(limit),
    )
    experts = _int(cfg, "n_routed_experts", where, 256)
    moe = MoESpec(
        num_experts=experts,
        top_k=_int(cfg, "num_experts_per_tok", where, 6),
        intermediate_size=_int(cfg, "moe_intermediate_size", where, 2048),
        num_shared_experts=1,
        scoring=str(cfg.get("scoring_func", "sqrtsoftplus")),
        renormalize=True,
        routed_scaling_factor=_float(cfg, "routed_scaling_factor", where, 1.5),
        score_bias=True,
    )
    return dict(
        head_dim=head_dim,
        num_kv_heads=1,
        rope_theta=_main_theta(cfg, where),
        rope_scaling=None,
        sliding_window=None,
        moe=moe,
        deepseek_v4=spec,
        num_nextn_layers=_int(cfg, "num_nextn_predict_layers", where, 0, low=0),
    )
