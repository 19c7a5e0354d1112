"""The DeepSeek V4 family: compressed attention, hyper-connections and hash-routed MoE, on shared layers.

The residual is ``hc_mult`` streams per token (layers/hyper_connections.py). A block collapses them
for RMSNorm -> attention (layers/compressed_attention.py: a sliding window plus, per layer,
compressed sparse or heavily compressed entries) and writes the output back into the streams, then
does the same around the MoE (layers/moe.py: ``sqrtsoftplus`` scores, the correction bias picking
experts, renormalized weights times ``routed_scaling_factor``, one shared expert, ``swiglu_limit``;
the first layers route by the fixed ``tid2eid`` table). Every layer has routed experts (V4 has no
dense layers). The streams are collapsed once more (the hyper head) before the final norm.

Sliding-only layers rotate with ``rope_theta``; compressed layers and their compressors with
``compress_rope_theta`` (YaRN when configured, without YaRN's cos/sin factor, as transformers does).

Checkpoint names are those ``DeepseekV4ForCausalLM.save_pretrained`` writes (DeepSeek's module names
under ``model.``: ``model.layers.{i}.attn.wq_a.weight``, ``ffn.experts.{e}.w1.weight``, ``hc_attn_fn``,
``head.weight``); DeepSeek's released files are renamed to them as they are read
(families/deepseek_v4_checkpoint.py). The MTP layers a checkpoint carries
(``model.layers.{num_hidden_layers + i}.*``) are the engine's draft source (``deepseek_v4_mtp.py``);
tensors under ``mtp.*`` (the released files' MTP naming) are read past.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from agent_infer.errors import EngineError, ModelLoadError
from agent_infer.model.config import DeepseekV4Spec, ModelConfig, rope_inv_freq
from agent_infer.model.families.base import CausalLM, Targets, model_kernels
from agent_infer.model.families.deepseek_v4_mtp import (
    DeepseekV4MTPStack,
    V4MTPLayer,
    load_mtp,
    mtp_config,
    split_mtp_tensors,
)
from agent_infer.model.kv_cache import KVCache
from agent_infer.model.layers.attention import AttentionMetadata
from agent_infer.model.layers.compressed_attention import CompressedAttention, CompressorPools
from agent_infer.model.layers.compressed_plan import CompressedPlan, plan_compressed
from agent_infer.model.layers.float_linear import PACKED_FLOAT
from agent_infer.model.layers.hyper_connections import HyperConnection, HyperHead, expand
from agent_infer.model.layers.interleaved_rotary import InterleavedRotary
from agent_infer.model.layers.kernels import Kernels
from agent_infer.model.layers.linear import Linear
from agent_infer.model.layers.moe import MoE, Scoring
from agent_infer.model.layers.norm import RMSNorm


def v4_rotaries(
    config: ModelConfig, spec: DeepseekV4Spec, native: bool = False
) -> tuple[InterleavedRotary, InterleavedRotary]:
    """The rotations of the sliding-only layers and of the compressed ones (``native``: float32 CPU
    rows rotate in native calls)."""
    base = dataclasses.replace(
        config, head_dim=spec.qk_rope_head_dim, rope_freq_factors=None, deepseek_v4=None
    )
    main = rope_inv_freq(dataclasses.replace(base, rope_scaling=None))
    compress = rope_inv_freq(
        dataclasses.replace(
            base, rope_theta=spec.compress_rope_theta, rope_scaling=spec.compress_rope_scaling
        )
    )
    return InterleavedRotary(main, native), InterleavedRotary(compress, native)


class DeepseekV4DecoderLayer(nn.Module):
    """One block (HF names under ``model.layers.{index}.``): hyper-connected attention, then MoE."""

    def __init__(
        self,
        config: ModelConfig,
        index: int,
        rotary: InterleavedRotary,
        kernels: Kernels,
        device: torch.device | None,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        spec, moe = config.deepseek_v4, config.moe
        assert spec is not None and moe is not None
        self.index = index
        self.p = f"model.layers.{index}."
        h = config.hidden_size
        self.attn_norm = RMSNorm(h, config.rms_norm_eps, device, dtype)
        self.ffn_norm = RMSNorm(h, config.rms_norm_eps, device, dtype)
        hc = (h, spec.hc_mult, spec.hc_sinkhorn_iters, spec.hc_eps, config.rms_norm_eps, device)
        #: Row-by-row native hyper-connections with the packed-float kernels (CPU, float32).
        self.native = kernels.name == PACKED_FLOAT
        self.hc_attn = HyperConnection(*hc, native=self.native)
        self.hc_ffn = HyperConnection(*hc, native=self.native)
        self.attn = CompressedAttention(config, index, rotary, kernels.linears, device, dtype)
        self.hashed = spec.hash_layers[index]
        self.moe = MoE(
            h,
            moe.intermediate_size,
            moe.num_experts,
            moe.top_k,
            scoring=cast(Scoring, moe.scoring),
            renormalize=True,
            routed_scaling_factor=moe.routed_scaling_factor,
            score_bias=not self.hashed,
            shared_intermediate_size=moe.intermediate_size,
            swiglu_limit=spec.swiglu_limit,
            device=device,
            dtype=dtype,
        )
        self.tid2eid: torch.Tensor | None
        self.register_buffer(
            "tid2eid",
            torch.zeros(config.vocab_size, moe.top_k, dtype=torch.int64, device=device)
            if self.hashed
            else None,
        )

    def forward(
        self,
        streams: torch.Tensor,
        ids: torch.Tensor,
        tables: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        plan: CompressedPlan,
    ) -> torch.Tensor:
        """The block applied to ``streams`` ``[R, hc_mult, hidden]`` (rows past ``plan.num_tokens`` are
        padding); ``tables`` are this layer's rotary cos/sin at the rows' positions."""
        post, comb, collapsed = self.hc_attn.collapse(streams)
        window, pools = cache.window(self.index), cache.compressor(self.index)
        comp = None
        if pools is not None:
            ring, positions = cache.state_ring(self.index)
            comp = CompressorPools(pools[0], pools[1], ring, positions)
        out = self.attn.forward(collapsed, self.attn_norm, tables, window, comp, plan)
        streams = expand(post, comb, out, streams, self.native)
        post, comb, collapsed = self.hc_ffn.collapse(streams)
        n = plan.num_tokens
        chosen = None if self.tid2eid is None else self.tid2eid.index_select(0, ids[:n])
        y = self.moe.forward_normed(collapsed[:n], self.ffn_norm, chosen)
        if int(streams.shape[0]) > n:
            y = torch.cat((y, y.new_zeros(int(streams.shape[0]) - n, int(y.shape[1]))))
        return expand(post, comb, y, streams, self.native)

    def load_targets(self) -> Targets:
        """HF names of the block's tensors."""
        p = self.p
        t: Targets = {}
        for name, tensor in (
            ("attn_norm.weight", self.attn_norm.weight),
            ("ffn_norm.weight", self.ffn_norm.weight),
            ("hc_attn_fn", self.hc_attn.fn),
            ("hc_attn_base", self.hc_attn.base),
            ("hc_attn_scale", self.hc_attn.scale),
            ("hc_ffn_fn", self.hc_ffn.fn),
            ("hc_ffn_base", self.hc_ffn.base),
            ("hc_ffn_scale", self.hc_ffn.scale),
        ):
            t[p + name] = (tensor, 0, tuple(tensor.shape))
        t.update(self.attn.load_targets())
        moe, q = self.moe, p + "ffn."
        hidden, inter = int(moe.router.shape[1]), int(moe.down.shape[2])
        t[q + "gate.weight"] = (moe.router, 0, tuple(moe.router.shape))
        if moe.score_bias is not None:
            t[q + "gate.bias"] = (moe.score_bias, 0, tuple(moe.score_bias.shape))
        if self.tid2eid is not None:
            t[q + "gate.tid2eid"] = (self.tid2eid, 0, tuple(self.tid2eid.shape))
        for e in range(moe.num_experts):
            x = f"{q}experts.{e}."
            t[x + "w1.weight"] = (moe.gate_up[e], 0, (inter, hidden))
            t[x + "w3.weight"] = (moe.gate_up[e], inter, (inter, hidden))
            t[x + "w2.weight"] = (moe.down[e], 0, (hidden, inter))
        assert moe.shared_gate_up is not None and moe.shared_down is not None
        x = q + "shared_experts."
        t[x + "w1.weight"] = (moe.shared_gate_up, 0, (inter, hidden))
        t[x + "w3.weight"] = (moe.shared_gate_up, inter, (inter, hidden))
        t[x + "w2.weight"] = (moe.shared_down, 0, (hidden, inter))
        return t


class DeepseekV4ForCausalLM(CausalLM[DeepseekV4DecoderLayer]):
    """DeepSeek V4 causal LM over the compressed layout of a paged :class:`KVCache` (torch kernels)."""

    kv_layout = "compressed"

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        kernels: Kernels | None = None,
    ) -> None:
        """``kernels`` defaults to the torch path (the only one this family runs)."""
        super().__init__()
        kernels = model_kernels(kernels, device, dtype)
        if kernels.name not in ("torch", PACKED_FLOAT):
            raise EngineError(f"DeepSeek V4 runs on the torch or {PACKED_FLOAT} kernels, not {kernels.name}")
        spec = config.deepseek_v4
        if spec is None or config.moe is None:
            raise EngineError("a DeepSeek V4 config needs its DeepseekV4Spec and MoE spec")
        c = config
        self.config = c
        self.dtype = dtype
        self.kernels = kernels
        self.embed = nn.Parameter(
            torch.empty(c.vocab_size, c.hidden_size, device=device, dtype=dtype), requires_grad=False
        )
        main, compress = v4_rotaries(c, spec, native=kernels.name == PACKED_FLOAT)
        self.main_rotary, self.compress_rotary = main, compress
        self.layers = nn.ModuleList(
            DeepseekV4DecoderLayer(c, i, compress if spec.compress_rates[i] else main, kernels, device, dtype)
            for i in range(c.num_layers)
        )
        self.hc_head = HyperHead(
            c.hidden_size,
            spec.hc_mult,
            spec.hc_eps,
            c.rms_norm_eps,
            device,
            native=kernels.name == PACKED_FLOAT,
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, device, dtype)
        self.lm_head: Linear = kernels.linears.head(
            "head.weight", c.vocab_size, c.hidden_size, tied=self.embed if c.tie_word_embeddings else None
        )
        wide = mtp_config(c)
        self.mtp = nn.ModuleList(
            V4MTPLayer(
                c,
                d,
                DeepseekV4DecoderLayer(wide, c.num_layers + d, main, kernels, device, dtype),
                kernels,
                device,
                dtype,
            )
            for d in range(c.num_nextn_layers)
        )
        #: Why the checkpoint's MTP modules were not loaded (None: loaded, or none declared).
        self.mtp_skipped: str | None = None

    def decoder_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        keep_rows: Sequence[int] | None,
    ) -> torch.Tensor:
        """The decoder over the compressed caches: window entries, compressor states and completed
        windows' entries written for the new tokens."""
        c = self.config
        n = int(input_ids.shape[0])
        spec = c.deepseek_v4
        assert spec is not None
        rates = {r for r in spec.compress_rates if r}
        views = plan_compressed(
            meta,
            n,
            kv_cache.num_slots,
            self.device,
            spec.sliding_window,
            rates,
            native=self.kernels.name == PACKED_FLOAT,
        )
        ids, pos = self.padded_inputs(input_ids, positions)
        x = F.embedding(ids, self.embed)
        tables = {False: self.main_rotary.tables(pos), True: self.compress_rotary.tables(pos)}
        streams = x[:, None, :].expand(int(ids.shape[0]), spec.hc_mult, c.hidden_size).contiguous()
        for layer, rate in zip(self.blocks(), spec.compress_rates, strict=True):
            streams = layer.forward(streams, ids, tables[bool(rate)], kv_cache, views)
        return self.select_rows(self.norm.forward(self.hc_head.forward(streams)), n, keep_rows)

    def weight_targets(self) -> Targets:
        """HF names of every tensor of the decoder (the MTP layers are not targets)."""
        h = self.hc_head
        t: Targets = {
            "model.embed_tokens.weight": (self.embed, 0, tuple(self.embed.shape)),
            "model.norm.weight": (self.norm.weight, 0, tuple(self.norm.weight.shape)),
            "model.hc_head.hc_fn": (h.fn, 0, tuple(h.fn.shape)),
            "model.hc_head.hc_base": (h.base, 0, tuple(h.base.shape)),
            "model.hc_head.hc_scale": (h.scale, 0, tuple(h.scale.shape)),
        }
        t.update(self.lm_head.load_targets())
        for layer in self.blocks():
            t.update(layer.load_targets())
        return t

    def ignored_weight_names(self) -> frozenset[str]:
        """A head tied to the embedding may still be stored."""
        return frozenset({"head.weight"}) if self.config.tie_word_embeddings else frozenset()

    def mtp_layers(self) -> list[V4MTPLayer]:
        """The loaded MTP modules, typed (empty when the checkpoint has none)."""
        return cast(list[V4MTPLayer], list(self.mtp))

    def mtp_stack(self) -> DeepseekV4MTPStack | None:
        """The loaded MTP modules as the engine's drafter runs them (None without any)."""
        layers = self.mtp_layers()
        if not layers:
            return None
        return DeepseekV4MTPStack(layers, self.embed, self.lm_head, self.main_rotary, self.config)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """:meth:`CausalLM.load_weights` of the decoder, then the MTP modules (dropped, with the reason
        in ``mtp_skipped``, when the checkpoint's MTP tensors are not exactly theirs); a ``tid2eid``
        entry outside the experts raises :class:`ModelLoadError` naming the tensor."""
        first = self.config.num_layers
        mtp = tuple(f"model.layers.{first + i}." for i in range(self.config.num_nextn_layers))
        found: dict[str, torch.Tensor] = {}
        rest = ((name, t) for name, t in named_tensors if not name.startswith("mtp."))
        super().load_weights(split_mtp_tensors(rest, mtp, found) if mtp else rest)
        layers = self.mtp_layers()
        if layers:
            self.mtp_skipped = load_mtp(layers, found)
            if self.mtp_skipped is not None:
                self.mtp = nn.ModuleList()
            for module in self.mtp_layers():
                # DeepSeek stores copies of the main embedding and head: keep one of each in memory.
                if module.embed is not None and torch.equal(module.embed, self.embed):
                    module.embed = None
                head = getattr(self.lm_head, "weight", None)
                if (
                    module.head is not None
                    and isinstance(head, torch.Tensor)
                    and torch.equal(module.head, head)
                ):
                    module.head = None
        assert self.config.moe is not None
        experts = self.config.moe.num_experts
        for layer in self.blocks():
            table = layer.tid2eid
            if table is not None and (int(table.min()) < 0 or int(table.max()) >= experts):
                raise ModelLoadError(
                    f"tensor '{layer.p}ffn.gate.tid2eid' routes to expert {int(table.max())} "
                    f"(or {int(table.min())}); the model has {experts}"
                )
