"""Multi-head latent attention (DeepSeek V2/V3) over the paged latent cache.

A token's keys and values are compressed into one latent ``c`` (``kv_lora_rank`` values, RMS-normed)
plus one rotated key ``k_r`` (``qk_rope_head_dim``) shared by all heads; the cache keeps exactly
``[c, k_r]`` per token per layer (:class:`~agent_infer.model.kv_cache.KVCache`'s latent layout).
Head ``h``'s key is ``[W_UK[h] c, k_r]`` and its value ``W_UV[h] c``, where ``kv_b_proj`` stacks
``W_UK``/``W_UV`` per head. Two equal ways to attend:

* **expanded** (prefill): expand every cached token's K and V with ``kv_b_proj`` and run SDPA over
  ``qk_nope + qk_rope`` wide heads; the expansion is paid once per context token and shared by the
  chunk's many queries.
* **absorbed** (decode): fold ``W_UK`` into the query (``q_c = W_UK[h]^T q_nope``) so scores are
  ``q_c . c + q_r . k_r`` straight against the cache rows, attend over the latents, then apply
  ``W_UV`` to the ``kv_lora_rank``-wide result; nothing is expanded per context token.

With ``native`` (the packed-float kernels: CPU, float32) every row attends in the absorbed form
with the decode kernel's arithmetic: the rows of chunks of at most :data:`ABSORB_MAX_QUERY` new
tokens (decode steps, drafts, forced tokens) in one native call per layer (``DecodeBatch.run_mla``,
engine_native/src/kernels/attention_mla.h), longer chunks in another
(``native_mla.mla_rows``, kernels/attention_mla_rows.cpp: tiles of consecutive rows sharing
each latent key they load, each row's operations in the single-row kernel's order). So a row's bits
depend only on its token and the context before it: prefill, chunked prefill, a prefix-cache hit
and decode agree bit for bit. The latent norm, both rotations and the new cache rows run in one more
call (``native_mla.mla_prep``).

On the torch path (other dtypes and devices, ``AGENT_INFER_NATIVE_LINEAR=0``) chunks of at most
:data:`ABSORB_MAX_QUERY` tokens take the absorbed form and longer ones the expanded form through
SDPA: the two agree within floating-point tolerance, not bit for bit, so there a prompt's logits
can move in the last bits with how it was chunked or what the prefix cache held.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from agent_infer.errors import EngineError
from agent_infer.model.config import ModelConfig, rope_scaling_type, yarn_mscale
from agent_infer.model.layers import native_mla, native_ops
from agent_infer.model.layers.attention import AttentionPlan, _SeqPlan
from agent_infer.model.layers.linear import Linear, LinearBuilder, WeightPart, in_row_chunks
from agent_infer.model.layers.norm import RMSNorm
from agent_infer.model.layers.rotary import Rotation, native_tables

#: Longest chunk of new tokens that attends in the absorbed form.
ABSORB_MAX_QUERY = 16

#: DeepSeek's q/kv latent norms use their own epsilon, not the config's ``rms_norm_eps``.
LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(config: ModelConfig) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` when set (as
    DeepSeek's reference and transformers scale the whole score, not only the rotary part)."""
    assert config.mla is not None
    scale = float(config.mla.qk_head_dim) ** -0.5
    scaling = config.rope_scaling
    if scaling is not None and rope_scaling_type(scaling) not in ("default",):
        mscale_all_dim = scaling.get("mscale_all_dim") or 0
        if mscale_all_dim:
            m = yarn_mscale(float(scaling["factor"]), float(mscale_all_dim))
            scale = scale * m * m
    return scale


class MultiHeadLatentAttention(nn.Module):
    """MLA of one layer (HF names under ``prefix`` = ``model.layers.{i}.self_attn.``).

    The q (or q_a) and kv_a projections share one fused call on the normed input; ``kv_b`` is held as
    a plain weight because both forms use it as a matrix.
    """

    def __init__(
        self,
        config: ModelConfig,
        prefix: str,
        linears: LinearBuilder,
        device: torch.device | None,
        dtype: torch.dtype,
        native: bool = False,
    ) -> None:
        """``native``: single-token sequences of plans without a decode batch (the MTP drafter's)
        also take the native absorbed kernel (float32 CPU models)."""
        super().__init__()
        m = config.mla
        if m is None:
            raise ValueError("MultiHeadLatentAttention needs a config with an MLA spec")
        self.spec = m
        self.native = native
        self.heads = config.num_heads
        self.q_width = m.q_lora_rank if m.q_lora_rank is not None else self.heads * m.qk_head_dim
        q_name = "q_a_proj.weight" if m.q_lora_rank is not None else "q_proj.weight"
        self.down: Linear = linears.linear(
            [
                WeightPart(prefix + q_name, self.q_width),
                WeightPart(prefix + "kv_a_proj_with_mqa.weight", m.latent_dim),
            ],
            config.hidden_size,
        )
        self.q_norm: RMSNorm | None = None
        self.q_up: Linear | None = None
        if m.q_lora_rank is not None:
            self.q_norm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS, device, dtype)
            self.q_up = linears.linear(
                [WeightPart(prefix + "q_b_proj.weight", self.heads * m.qk_head_dim)], m.q_lora_rank
            )
        self.kv_norm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS, device, dtype)
        self.kv_b = nn.Parameter(
            torch.empty(
                self.heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, device=device, dtype=dtype
            ),
            requires_grad=False,
        )
        self.kv_b_name = prefix + "kv_b_proj.weight"
        self.o: Linear = linears.linear(
            [WeightPart(prefix + "o_proj.weight", config.hidden_size)], self.heads * m.v_head_dim
        )
        self.scale = mla_softmax_scale(config)
        rope = m.qk_rope_head_dim
        # Interleaved pairs (x0, x1), (x2, x3)... reordered to the rotate-half layout (evens, then odds);
        # q and k get the same order, so their dot products are those of the interleaved rotation.
        self.rope_order = (
            torch.cat((torch.arange(0, rope, 2), torch.arange(1, rope, 2))).to(device)
            if m.rope_interleave
            else None
        )
        self.absorb_max_query = ABSORB_MAX_QUERY
        #: Chunks of more than ABSORB_MAX_QUERY rows on the tiled absorbed kernel (with ``native``);
        #: benchmarks/mla_prefill.py turns it off to time the torch forms as a peer in the same run.
        self.tiled_chunks = native

    def load_targets(self) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]:
        """HF names of every tensor of the layer."""
        t = self.down.load_targets()
        if self.q_up is not None and self.q_norm is not None:
            t.update(self.q_up.load_targets())
            t[self.kv_b_name.replace("kv_b_proj", "q_a_layernorm")] = (
                self.q_norm.weight,
                0,
                tuple(self.q_norm.weight.shape),
            )
        t[self.kv_b_name.replace("kv_b_proj", "kv_a_layernorm")] = (
            self.kv_norm.weight,
            0,
            tuple(self.kv_norm.weight.shape),
        )
        t[self.kv_b_name] = (self.kv_b, 0, tuple(self.kv_b.shape))
        t.update(self.o.load_targets())
        return t

    def forward(
        self, x: torch.Tensor, norm: RMSNorm, rotation: Rotation, cache: torch.Tensor, plan: AttentionPlan
    ) -> torch.Tensor:
        """Attention output ``[R, hidden]`` for ``norm(x)`` (``x`` ``[R, hidden]``), writing the new tokens'
        latent entries into ``cache`` (``[num_slots, latent_dim]``); rows past ``plan.num_tokens`` are padding."""
        m, heads = self.spec, self.heads
        rows, n = int(x.shape[0]), plan.num_tokens
        nope, rope, lora = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank
        h = self.down.project_normed(x, norm)
        q = h[:, : self.q_width]
        if self.q_up is not None and self.q_norm is not None:
            q = self.q_up.project_normed(q, self.q_norm)
        q = q.reshape(rows, heads, m.qk_head_dim)
        rope_tables = native_tables(rotation) if self.native else None
        if rope_tables is not None:
            # One native call: the latent norm, both rotations and the cache rows.
            q_rope = native_mla.mla_prep(
                q, h, self.q_width, lora, self.kv_norm.weight, self.kv_norm.eps, rope_tables,
                self.rope_order is not None, cache, plan.slot_mapping, n,
            )  # fmt: skip
            q_nope = q[:, :, :nope]
        else:
            latent = self.kv_norm.forward(h[:, self.q_width : self.q_width + lora])
            ropes = torch.cat((q[:, :, nope:], h[:, None, self.q_width + lora :]), dim=1)
            if self.rope_order is not None:
                ropes = ropes.index_select(2, self.rope_order)
            ropes = rotation.apply(ropes.reshape(rows, (heads + 1) * rope), heads + 1, rope)
            q_nope, q_rope, k_rope = q[:, :, :nope], ropes[:, :heads], ropes[:, heads]
            cache.index_copy_(0, plan.slot_mapping, torch.cat((latent[:n], k_rope[:n]), dim=-1))
        if plan.decode is not None or self.native:
            return self.o.project(self._with_native(q_nope, q_rope, cache, plan, rows))
        outs = []
        for s in plan.seqs:
            form = self._absorbed if s.end - s.start <= self.absorb_max_query else self._expanded
            outs.append(form(q_nope[s.start : s.end], q_rope[s.start : s.end], cache, s))
        if rows > n:
            outs.append(x.new_zeros(rows - n, heads * m.v_head_dim))
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return self.o.project(out)

    def _with_native(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, plan: AttentionPlan, rows: int
    ) -> torch.Tensor:
        """The attention output of every row in the absorbed form's native arithmetic: the decode
        batch's rows in one call (engine_native/src/kernels/attention_mla.h) and, with ``native``,
        every chunk's rows in another (kernels/attention_mla_rows.cpp), each row bit-identical to
        decoding its token alone. Without ``native`` the chunks take the torch forms."""
        m, heads = self.spec, self.heads
        qn = q_nope if q_nope.stride(2) == 1 else q_nope.contiguous()
        qr = q_rope if q_rope.stride(2) == 1 else q_rope.contiguous()
        if not (
            cache.dtype is torch.float32
            and cache.device.type == "cpu"
            and cache.is_contiguous()
            and int(cache.shape[1]) == m.latent_dim
            and self.kv_b.dtype is torch.float32
            and self.kv_b.is_contiguous()
            and qn.dtype is torch.float32
            and qr.dtype is torch.float32
            and qn.device.type == "cpu"
        ):
            raise EngineError(
                "native MLA attention needs float32 CPU tensors and a contiguous latent cache "
                f"[slots, {m.latent_dim}]; got cache {tuple(cache.shape)} {cache.dtype} on {cache.device}"
            )
        decode = plan.decode
        chunks = plan.seqs if self.tiled_chunks else []
        covered = (len(decode.rows) if decode is not None else 0) + sum(s.end - s.start for s in chunks)
        # Rows no kernel writes (padding, or none when every row is covered) must read as zeros.
        alloc = torch.zeros if covered < rows else torch.empty
        out = alloc(rows, heads * m.v_head_dim, dtype=torch.float32)
        nope, rope, lora, v = m.qk_nope_head_dim, m.qk_rope_head_dim, m.kv_lora_rank, m.v_head_dim
        strides = (qn.stride(0), qn.stride(1), qr.stride(0), qr.stride(1))
        if decode is not None:
            work = heads * (len(decode.rows) * lora * (nope + v) + decode.keys * (2 * lora + rope))
            threads = native_ops.threads_for(work) if decode.keys else native_ops.get_num_threads()
            decode.native.run_mla(
                qn.data_ptr(), qr.data_ptr(), cache.data_ptr(), self.kv_b.data_ptr(), out.data_ptr(), heads,
                nope, rope, lora, v, self.scale, threads, *strides,
            )  # fmt: skip
        if chunks:
            spans, keys = [], 0
            for s in chunks:
                n, ctx = s.end - s.start, int(s.gather.shape[0])
                # A bottom-right causal mask always lets the last row see the first key; a band
                # (sliding-window) mask would not, and the kernel has no band.
                if s.mask is not None and not bool(s.mask[-1, 0]):
                    raise EngineError(f"native MLA: rows [{s.start}, {s.end}) carry a non-causal mask")
                spans.append((s.start, n, ctx))
                keys += n * (ctx - n) + n * (n + 1) // 2
            batch = native_mla.mla_rows(
                torch.tensor(spans, dtype=torch.int64),
                torch.cat([s.gather for s in chunks]),
                rows,
                int(cache.shape[0]),
            )
            chunk_rows = sum(n for _, n, _ in spans)
            work = heads * (chunk_rows * lora * (nope + v) + keys * (2 * lora + rope))
            batch.run(
                qn.data_ptr(), qr.data_ptr(), cache.data_ptr(), self.kv_b.data_ptr(), out.data_ptr(), heads,
                nope, rope, lora, v, self.scale, native_ops.threads_for(work), *strides,
            )  # fmt: skip
        for s in plan.seqs if not self.tiled_chunks else []:
            form = self._absorbed if s.end - s.start <= self.absorb_max_query else self._expanded
            out[s.start : s.end] = form(q_nope[s.start : s.end], q_rope[s.start : s.end], cache, s)
        return out

    def _expanded(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, s: _SeqPlan
    ) -> torch.Tensor:
        m, heads = self.spec, self.heads
        ctx = cache.index_select(0, s.gather)
        length = int(ctx.shape[0])
        w = self.kv_b
        kv = in_row_chunks(lambda c: F.linear(c, w), ctx[:, : m.kv_lora_rank]).view(
            length, heads, m.qk_nope_head_dim + m.v_head_dim
        )
        k_rope = ctx[:, None, m.kv_lora_rank :].expand(length, heads, m.qk_rope_head_dim)
        k = torch.cat((kv[:, :, : m.qk_nope_head_dim], k_rope), dim=-1).transpose(0, 1)
        v = kv[:, :, m.qk_nope_head_dim :].transpose(0, 1)
        q = torch.cat((q_nope, q_rope), dim=-1).transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=s.mask, is_causal=s.causal, scale=self.scale)
        return o.transpose(0, 1).reshape(s.end - s.start, heads * m.v_head_dim)

    def _absorbed(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, s: _SeqPlan
    ) -> torch.Tensor:
        m, heads = self.spec, self.heads
        w = self.kv_b.view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        w_uk, w_uv = w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]
        # bmm over the strided views of kv_b reads the weights in place (einsum copies them first)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk)
        q = torch.cat((q_latent, q_rope.transpose(0, 1)), dim=-1)
        ctx = cache.index_select(0, s.gather)
        length = int(ctx.shape[0])
        k = ctx[None].expand(heads, length, m.latent_dim)
        v = ctx[None, :, : m.kv_lora_rank].expand(heads, length, m.kv_lora_rank)
        o_latent = F.scaled_dot_product_attention(
            q, k, v, attn_mask=s.mask, is_causal=s.causal, scale=self.scale
        )
        out = torch.bmm(o_latent, w_uv.transpose(1, 2))
        return out.transpose(0, 1).reshape(s.end - s.start, heads * m.v_head_dim)
