"""What Gemma 3 checkpoints say and how: GGUF tensor names, the settings read from ``config.json``
and from GGUF metadata (with llama.cpp's values where GGUF files store none), and the chat template
for GGUF files that carry none. The model itself is :mod:`.gemma3`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from agent_infer.errors import UnsupportedModelError
from agent_infer.model.config import ModelConfig

SLIDING, FULL = "sliding_attention", "full_attention"
#: Every sixth layer is global unless the checkpoint says otherwise (HF's and llama.cpp's default).
DEFAULT_PATTERN = 6
#: llama.cpp's RoPE base for Gemma 3's sliding layers (GGUF files do not store it).
DEFAULT_LOCAL_THETA = 10000.0

GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _pattern_types(num_layers: int, pattern: int) -> tuple[str, ...]:
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


#: transformers' ``Gemma3TextConfig`` defaults: multimodal configs list only what differs from them.
TEXT_CONFIG_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
    "sliding_window": 4096, "query_pre_attn_scalar": 256, "max_position_embeddings": 131072,
    "hidden_activation": "gelu_pytorch_tanh", "rope_theta": 1_000_000.0,
    "rope_local_base_freq": DEFAULT_LOCAL_THETA, "bos_token_id": 2, "eos_token_id": 1,
}  # fmt: skip


def hf_text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal ``config.json``'s ``text_config`` over the text defaults; a text config as it is."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    return {
        **TEXT_CONFIG_DEFAULTS,
        **text,
        "architectures": cfg.get("architectures"),
        "tie_word_embeddings": tie,
    }


def hf_config_fields(cfg: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """:class:`ModelConfig` fields of a Gemma 3 ``config.json`` beyond the common ones."""
    if cfg.get("attn_logit_softcapping") is not None:
        raise UnsupportedModelError(
            f"{where}attn_logit_softcapping (attention-logit soft-capping) is not supported"
        )
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if not types:
        types = _pattern_types(layers, int(cfg.get("sliding_window_pattern") or DEFAULT_PATTERN))
    rope = cfg.get("rope_parameters") or {}
    full = rope.get(FULL) or {}
    local = rope.get(SLIDING) or {}
    theta = float(full.get("rope_theta", cfg.get("rope_theta", 1_000_000.0)))
    local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", DEFAULT_LOCAL_THETA)))
    scaling = cfg.get("rope_scaling") or (full if full.get("rope_type", "default") != "default" else None)
    cap = cfg.get("final_logit_softcapping")
    return {
        "sliding_window": int(cfg["sliding_window"]),
        "layer_types": tuple(str(t) for t in types),
        "rope_theta": theta,
        "rope_local_theta": local_theta,
        "rope_scaling": dict(scaling) if scaling else None,
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar") or cfg.get("head_dim") or 256),
        "final_logit_softcapping": None if cap is None else float(cap),
        "hidden_activation": str(
            cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        ),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)),
    }


def gguf_options(meta: dict[str, Any], config: ModelConfig) -> dict[str, Any]:
    """:class:`ModelConfig` fields of a ``gemma3`` GGUF file beyond the common ones, as llama.cpp reads them."""
    arch = config.architecture
    pattern = int(meta.get(f"{arch}.attention.sliding_window_pattern", DEFAULT_PATTERN))
    # llama.cpp scales the 27B model (62 layers) by hidden/heads, every other size by head_dim
    scalar = config.hidden_size / config.num_heads if config.num_layers == 62 else config.head_dim
    cap = meta.get(f"{arch}.final_logit_softcapping")
    return {
        "sliding_window": int(meta[f"{arch}.attention.sliding_window"]),
        "layer_types": _pattern_types(config.num_layers, pattern),
        "rope_local_theta": DEFAULT_LOCAL_THETA,
        "query_pre_attn_scalar": float(scalar),
        "final_logit_softcapping": None if cap is None else float(cap),
        "hidden_activation": "gelu_pytorch_tanh",
    }


#: Gemma 3's chat template (Google's, text parts only), for GGUF files that carry none.
CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""
