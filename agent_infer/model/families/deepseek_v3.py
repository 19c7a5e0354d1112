"""The DeepSeek V3 family: multi-head latent attention and DeepSeekMoE, on shared layers.

A decoder block is RMSNorm -> MLA (layers/mla.py, latent cache) then RMSNorm -> a dense SwiGLU MLP
(the first ``first_k_dense_replace`` layers) or DeepSeekMoE (layers/moe.py: sigmoid scores, the
``e_score_correction_bias`` choosing experts, group-limited top-k, renormalized weights scaled by
``routed_scaling_factor``, shared experts), each with a residual.

Checkpoint names are DeepSeek's own (``mlp.experts.{e}.gate_proj.weight``, ``mlp.gate.weight``,
``mlp.gate.e_score_correction_bias``, ``mlp.shared_experts.*``). The MTP/NextN layers a checkpoint
carries after the decoder (``model.layers.{num_hidden_layers + i}.*``) are loaded into
:class:`~agent_infer.model.families.deepseek_mtp.MTPLayer` modules (the engine's draft source); a
checkpoint whose config names MTP layers but stores none of their tensors loads without them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from agent_infer.errors import EngineError, ModelLoadError
from agent_infer.model.config import MLASpec, ModelConfig, MoESpec, rope_scaling_type
from agent_infer.model.families.base import CausalLM, Targets
from agent_infer.model.families.deepseek_mtp import (
    OPTIONAL_SUFFIXES,
    DeepseekMTPStack,
    MTPLayer,
    split_mtp_name,
)
from agent_infer.model.kv_cache import KVCache
from agent_infer.model.layers.attention import (
    AttentionMetadata,
    AttentionPlan,
    NativePagedAttention,
    PagedAttention,
)
from agent_infer.model.layers.float_linear import PACKED_FLOAT
from agent_infer.model.layers.kernels import Kernels, torch_kernels
from agent_infer.model.layers.linear import Linear
from agent_infer.model.layers.mla import ABSORB_MAX_QUERY, MultiHeadLatentAttention
from agent_infer.model.layers.mlp import GatedMLP
from agent_infer.model.layers.moe import MoE
from agent_infer.model.layers.norm import RMSNorm
from agent_infer.model.layers.rotary import Rotation

_SCORING = ("sigmoid",)
_TOPK_METHODS = ("noaux_tc",)


def _int(cfg: Mapping[str, Any], key: str, where: str, default: int | None = None, low: int = 1) -> int:
    value = cfg.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ModelLoadError(f"{where}{key} must be an integer >= {low}, got {value!r}")
    return value


def hf_config_fields(cfg: Mapping[str, Any], where: str = "") -> dict[str, Any]:
    """The DeepSeek V3 fields of ``config.json`` as :class:`ModelConfig` keyword arguments.

    Raises :class:`ModelLoadError` naming the key of any value this family does not implement.
    """
    for key, allowed, default in (
        ("scoring_func", _SCORING, "sigmoid"),
        ("topk_method", _TOPK_METHODS, "noaux_tc"),
        ("hidden_act", ("silu",), "silu"),
    ):
        value = cfg.get(key, default)
        if value not in allowed:
            raise ModelLoadError(f"{where}unsupported {key} {value!r}; supported: {', '.join(allowed)}")
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = rope_scaling_type(scaling) if scaling else "default"
    if kind not in ("default", "yarn"):
        raise ModelLoadError(
            f"{where}unsupported rope_scaling type {kind!r} for DeepSeek V3; supported: yarn"
        )
    q_lora = cfg.get("q_lora_rank")
    mla = MLASpec(
        kv_lora_rank=_int(cfg, "kv_lora_rank", where),
        q_lora_rank=None if q_lora is None else _int(cfg, "q_lora_rank", where),
        qk_nope_head_dim=_int(cfg, "qk_nope_head_dim", where),
        qk_rope_head_dim=_int(cfg, "qk_rope_head_dim", where),
        v_head_dim=_int(cfg, "v_head_dim", where),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )
    if mla.qk_rope_head_dim % 2:
        raise ModelLoadError(f"{where}qk_rope_head_dim must be even, got {mla.qk_rope_head_dim}")
    experts = _int(cfg, "n_routed_experts", where)
    groups = _int(cfg, "n_group", where, 1) if cfg.get("n_group") is not None else 1
    topk_groups = _int(cfg, "topk_group", where, 1) if cfg.get("topk_group") is not None else 1
    top_k = _int(cfg, "num_experts_per_tok", where)
    if experts % groups or (groups > 1 and experts // groups < 2):
        raise ModelLoadError(
            f"{where}n_routed_experts={experts} does not split into n_group={groups} groups of >= 2"
        )
    if topk_groups > groups:
        raise ModelLoadError(f"{where}topk_group={topk_groups} exceeds n_group={groups}")
    if top_k > topk_groups * (experts // groups):
        raise ModelLoadError(f"{where}num_experts_per_tok={top_k} exceeds the experts of topk_group groups")
    moe = MoESpec(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=_int(cfg, "moe_intermediate_size", where),
        num_shared_experts=_int(cfg, "n_shared_experts", where, 0, low=0)
        if cfg.get("n_shared_experts") is not None
        else 0,
        scoring="sigmoid",
        renormalize=bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        score_bias=True,
        num_groups=groups,
        topk_groups=topk_groups,
        first_dense_layers=_int(cfg, "first_k_dense_replace", where, 0, low=0),
        layer_freq=_int(cfg, "moe_layer_freq", where, 1),
    )
    heads = _int(cfg, "num_attention_heads", where)
    kv_heads = cfg.get("num_key_value_heads") or heads
    if kv_heads != heads:
        raise ModelLoadError(f"{where}num_key_value_heads={kv_heads} must equal num_attention_heads for MLA")
    return dict(
        head_dim=mla.qk_rope_head_dim,
        num_kv_heads=heads,
        mla=mla,
        moe=moe,
        num_nextn_layers=_int(cfg, "num_nextn_predict_layers", where, 0, low=0),
    )


class DeepseekV3DecoderLayer(nn.Module):
    """One decoder block (HF names under ``model.layers.{index}.``): MLA, then a dense MLP or DeepSeekMoE."""

    def __init__(
        self,
        config: ModelConfig,
        index: int,
        kernels: Kernels,
        device: torch.device | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        c = config
        self.prefix = p = f"model.layers.{index}."
        self.input_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.post_norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.attn = MultiHeadLatentAttention(
            c, p + "self_attn.", kernels.linears, device, dtype, native=kernels.name == PACKED_FLOAT
        )
        spec = c.moe
        self.mlp: GatedMLP | None = None
        self.moe: MoE | None = None
        if spec is not None and spec.is_moe_layer(index):
            self.moe = MoE(
                c.hidden_size,
                spec.intermediate_size,
                spec.num_experts,
                spec.top_k,
                scoring="sigmoid",
                renormalize=spec.renormalize,
                routed_scaling_factor=spec.routed_scaling_factor,
                score_bias=spec.score_bias,
                shared_intermediate_size=spec.intermediate_size * spec.num_shared_experts,
                num_groups=spec.num_groups,
                topk_groups=spec.topk_groups,
                device=device,
                dtype=dtype,
            )
        else:
            self.mlp = GatedMLP(kernels.linears, p + "mlp.", c.hidden_size, c.intermediate_size)

    def forward(
        self, x: torch.Tensor, rotation: Rotation, cache: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        """The block applied to ``x`` ``[rows, hidden]`` (rows past ``plan.num_tokens`` are padding)."""
        x = x + self.attn.forward(x, self.input_norm, rotation, cache, plan)
        if self.mlp is not None:
            return x + self.mlp.forward(x, self.post_norm)
        assert self.moe is not None
        n = plan.num_tokens
        y = self.moe.forward_normed(x[:n], self.post_norm)  # padding rows would only add expert work
        if int(x.shape[0]) > n:
            y = torch.cat((y, y.new_zeros(int(x.shape[0]) - n, int(y.shape[1]))))
        return x + y

    def load_targets(self) -> Targets:
        """HF names of the block's tensors."""
        p = self.prefix
        t: Targets = {
            p + "input_layernorm.weight": (self.input_norm.weight, 0, tuple(self.input_norm.weight.shape)),
            p + "post_attention_layernorm.weight": (
                self.post_norm.weight,
                0,
                tuple(self.post_norm.weight.shape),
            ),
        }
        t.update(self.attn.load_targets())
        if self.mlp is not None:
            t.update(self.mlp.gate_up.load_targets())
            t.update(self.mlp.down.load_targets())
        if self.moe is not None:
            t.update(_moe_targets(self.moe, p + "mlp."))
        return t


def _moe_targets(moe: MoE, p: str) -> Targets:
    hidden = int(moe.router.shape[1])
    inter = int(moe.down.shape[2])
    t: Targets = {p + "gate.weight": (moe.router, 0, tuple(moe.router.shape))}
    if moe.score_bias is not None:
        t[p + "gate.e_score_correction_bias"] = (moe.score_bias, 0, tuple(moe.score_bias.shape))
    for e in range(moe.num_experts):
        q = f"{p}experts.{e}."
        t[q + "gate_proj.weight"] = (moe.gate_up[e], 0, (inter, hidden))
        t[q + "up_proj.weight"] = (moe.gate_up[e], inter, (inter, hidden))
        t[q + "down_proj.weight"] = (moe.down[e], 0, (hidden, inter))
    if moe.shared_gate_up is not None and moe.shared_down is not None:
        shared = int(moe.shared_down.shape[1])
        q = p + "shared_experts."
        t[q + "gate_proj.weight"] = (moe.shared_gate_up, 0, (shared, hidden))
        t[q + "up_proj.weight"] = (moe.shared_gate_up, shared, (shared, hidden))
        t[q + "down_proj.weight"] = (moe.shared_down, 0, (hidden, shared))
    return t


class DeepseekV3ForCausalLM(CausalLM[DeepseekV3DecoderLayer]):
    """DeepSeek V3 causal LM over the latent layout of a paged :class:`KVCache` (torch kernels)."""

    kv_layout = "latent"

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        kernels: Kernels | None = None,
    ) -> None:
        """``kernels`` defaults to the torch path; the loader gives HF folders on the CPU in float32
        the packed-float kernels (layers/float_linear.py)."""
        super().__init__()
        if kernels is None:
            kernels = torch_kernels(device, dtype)
        if kernels.name not in ("torch", PACKED_FLOAT):
            raise EngineError(f"DeepSeek V3 runs on the torch or {PACKED_FLOAT} kernels, not {kernels.name}")
        if config.mla is None:
            raise EngineError("a DeepSeek V3 config needs its MLA spec")
        c = config
        self.config = c
        self.dtype = dtype
        self.kernels = kernels
        self.embed = nn.Parameter(
            torch.empty(c.vocab_size, c.hidden_size, device=device, dtype=dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(c, i, kernels, device, dtype) for i in range(c.num_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.lm_head: Linear = kernels.linears.head(
            "lm_head.weight", c.vocab_size, c.hidden_size, tied=self.embed if c.tie_word_embeddings else None
        )
        self.rotary = kernels.rotary(c, device, dtype)
        self.mtp = nn.ModuleList(
            MTPLayer(
                c,
                d,
                DeepseekV3DecoderLayer(c, c.num_layers + d, kernels, device, dtype),
                kernels,
                device,
                dtype,
            )
            for d in range(c.num_nextn_layers)
        )
        self._seen_mtp = True  # whether the checkpoint being loaded stores MTP tensors
        # The torch path attends per sequence (SDPA plans); with packed kernels the rows of short
        # chunks go to the native absorbed-MLA decode kernel in one call per layer, longer chunks to
        # its tiled form (layers/mla.py), so every row rounds as decoding it would.
        self.planner = (
            NativePagedAttention(ABSORB_MAX_QUERY) if kernels.name == PACKED_FLOAT else PagedAttention()
        )

    def decoder_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        keep_rows: Sequence[int] | None,
    ) -> torch.Tensor:
        """The decoder over the latent caches."""
        n = int(input_ids.shape[0])
        plan = self.planner.plan(meta, n, kv_cache.num_slots, self.device)
        ids, pos = self.padded_inputs(input_ids, positions)
        rotation = self.rotary.at(pos)
        x = F.embedding(ids, self.embed)
        for i, layer in enumerate(self.blocks()):
            x = layer.forward(x, rotation, kv_cache.latent(i), plan)
        return self.select_rows(self.norm.forward(x), n, keep_rows)

    def mtp_layers(self) -> list[MTPLayer]:
        """The loaded MTP modules, typed (empty when the checkpoint has none)."""
        return cast(list[MTPLayer], list(self.mtp))

    def mtp_stack(self) -> DeepseekMTPStack | None:
        """The loaded MTP modules as the engine's drafter runs them (None without any)."""
        layers = self.mtp_layers()
        if not layers or self.config.mla is None:
            return None
        return DeepseekMTPStack(layers, self.embed, self.lm_head, self.rotary, self.config.mla.latent_dim)

    def weight_targets(self) -> Targets:
        """HF names of every tensor of the decoder and its MTP modules (their own embedding and head
        are optional and taken in :meth:`load_weights`)."""
        t: Targets = {
            "model.embed_tokens.weight": (self.embed, 0, tuple(self.embed.shape)),
            "model.norm.weight": (self.norm.weight, 0, tuple(self.norm.weight.shape)),
        }
        t.update(self.lm_head.load_targets())
        for layer in self.blocks():
            t.update(layer.load_targets())
        for mtp in self.mtp_layers():
            t.update(mtp.load_targets())
        return t

    def ignored_weight_names(self) -> frozenset[str]:
        """A head tied to the embedding may still be stored."""
        return frozenset({"lm_head.weight"}) if self.config.tie_word_embeddings else frozenset()

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """:meth:`CausalLM.load_weights`, with the MTP modules' optional tensors copied into tensors of
        their own. When the checkpoint stores no MTP tensor at all, the model drops its MTP modules
        (a config may name MTP layers its checkpoint was stripped of); a partial set raises
        :class:`ModelLoadError` naming the missing tensors."""
        layers = self.mtp_layers()
        self._seen_mtp = False
        super().load_weights(self._take_optional_mtp(named_tensors, layers) if layers else named_tensors)
        if layers and not self._seen_mtp:
            self.mtp = nn.ModuleList()
        for layer in self.mtp_layers():
            # DeepSeek stores copies of the main embedding and head: keep one of each in memory.
            if layer.embed is not None and torch.equal(layer.embed, self.embed):
                layer.embed = None
            head = getattr(self.lm_head, "weight", None)
            if layer.head is not None and isinstance(head, torch.Tensor) and torch.equal(layer.head, head):
                layer.head = None

    def _take_optional_mtp(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], layers: list[MTPLayer]
    ) -> Iterable[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            found = split_mtp_name(name, layers)
            if found is None:
                yield name, tensor
                continue
            self._seen_mtp = True
            layer, suffix = found
            if suffix not in OPTIONAL_SUFFIXES:
                yield name, tensor
                continue
            if tuple(tensor.shape) != layer.shape:
                raise ModelLoadError(
                    f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {layer.shape}"
                )
            with torch.no_grad():
                layer.own(suffix).copy_(tensor)

    def accept_missing(self, missing: list[str]) -> list[str]:
        """Missing MTP tensors are no error when the checkpoint stores none of them."""
        if self._seen_mtp:
            return missing
        prefixes = tuple(layer.prefix for layer in self.mtp_layers())
        return [name for name in missing if not name.startswith(prefixes)]
