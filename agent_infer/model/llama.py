"""Llama / Qwen2 decoder with a paged KV cache, written for batch-invariant CPU inference.

Batch invariance: MKL's sgemm (and oneDNN's bf16 gemm) gives a row bit-identical results for any
row count that is a multiple of 4 on some CPUs (measured with 1..16 threads; 1-3 rows, or a 1-3
row tail split off to a thread, take other kernels), but not on all: on a Xeon with AMX, 13-16
rows and more take other kernels again. So every forward pads its rows to a multiple of
:data:`ROW_MULTIPLE` and, on the CPU, runs each torch matmul in chunks of exactly that many rows
(one kernel shape for every row, whatever the batch); the other ops are row-wise and attention
runs per sequence, so a sequence's logits do not depend on its batch. On GPUs this padding is not known to suffice (cuBLAS picks
kernels by shape) and invariance is untested there.
The padding costs about 40% of batch-1 decode matmul time on CPU (4 rows instead of 1).

GGUF models on the CPU in float32 instead keep their projection and LM-head weights packed for the
native kernel (:mod:`agent_infer.model.qlinear`), which is batch invariant by construction, so
those models run without padding. ``AGENT_INFER_NATIVE_LINEAR=0`` selects the torch path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from agent_infer import envs
from agent_infer.errors import EngineError, ModelLoadError
from agent_infer.model.attention import AttentionMetadata, paged_attention, plan_attention
from agent_infer.model.config import ModelConfig, rope_inv_freq
from agent_infer.model.kv_cache import KVCache
from agent_infer.model.qlinear import QuantLinear, gguf_rows, thread_budget
from agent_infer.model.rope import native_rope_ok, rope_in_place, rotate_half

if TYPE_CHECKING:
    from agent_infer.model.gguf_reader import GGUFFile

ROW_MULTIPLE = 4

# HF buffers that some checkpoints carry but which we recompute.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def _pad_rows(n: int) -> int:
    return -(-n // ROW_MULTIPLE) * ROW_MULTIPLE


def _param(*shape: int, device: torch.device | None, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


_Weight = nn.Parameter | QuantLinear

# Projections that a packed model keeps in QuantLinear modules: layer attribute -> HF weight names.
_PACKED_PROJECTIONS = {
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "o": ("self_attn.o_proj.weight",),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "down": ("mlp.down_proj.weight",),
}
# The GGUF names of the same tensors, in the same order.
_GGUF_PROJECTIONS = {
    "qkv": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "o": ("attn_output.weight",),
    "gate_up": ("ffn_gate.weight", "ffn_up.weight"),
    "down": ("ffn_down.weight",),
}


def _in_row_chunks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` (row-wise) over ``x`` in chunks of ROW_MULTIPLE rows on the CPU: one GEMM shape for
    every row, so a row's bits cannot depend on how many rows share the call."""
    n = int(x.shape[0])
    if x.device.type != "cpu" or n <= ROW_MULTIPLE:
        return fn(x)
    return torch.cat([fn(x[i : i + ROW_MULTIPLE]) for i in range(0, n, ROW_MULTIPLE)])


def _linear(x: torch.Tensor, weight: _Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, QuantLinear):
        y = weight.project(x)
        return y if bias is None else y.add_(bias)
    w: torch.Tensor = weight
    return _in_row_chunks(lambda h: F.linear(h, w, bias), x)


def _norm_linear(
    x: torch.Tensor, norm: torch.Tensor, eps: float, weight: _Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``linear(rms_norm(x) * norm)``; packed layers normalize inside the kernel call."""
    if isinstance(weight, QuantLinear):
        y = weight.project_normed(x, norm, eps)
        return y if bias is None else y.add_(bias)
    w: torch.Tensor = weight
    return _in_row_chunks(lambda h: F.linear(F.rms_norm(h, (h.shape[-1],), norm, eps), w, bias), x)


class _Layer(nn.Module):
    """One decoder block; q/k/v and gate/up are fused into single matmuls to halve Python overhead."""

    qkv: _Weight
    o: _Weight
    gate_up: _Weight
    down: _Weight

    def __init__(
        self, config: ModelConfig, device: torch.device | None, dtype: torch.dtype, packed: bool = False
    ) -> None:
        super().__init__()
        c = config
        self.input_norm = _param(c.hidden_size, device=device, dtype=dtype)
        self.post_norm = _param(c.hidden_size, device=device, dtype=dtype)
        self.qkv_bias = (
            _param(c.q_size + 2 * c.kv_size, device=device, dtype=dtype) if c.attention_bias else None
        )
        if packed:
            return  # QuantLinear modules arrive in LlamaForCausalLM.load_packed_gguf
        self.qkv = _param(c.q_size + 2 * c.kv_size, c.hidden_size, device=device, dtype=dtype)
        self.o = _param(c.hidden_size, c.q_size, device=device, dtype=dtype)
        self.gate_up = _param(2 * c.intermediate_size, c.hidden_size, device=device, dtype=dtype)
        self.down = _param(c.hidden_size, c.intermediate_size, device=device, dtype=dtype)


class LlamaForCausalLM(nn.Module):
    """Llama-architecture causal LM (Qwen2 = Llama + q/k/v bias) over a paged :class:`KVCache`."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    packed_head: QuantLinear | None

    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        packed: bool = False,
    ) -> None:
        """``packed``: projections and LM head come from :meth:`load_packed_gguf` (CPU float32 only)."""
        super().__init__()
        if packed and (dtype != torch.float32 or (device is not None and torch.device(device).type != "cpu")):
            raise EngineError("packed (native kernel) weights need a float32 model on the CPU")
        self.config = config
        self.dtype = dtype
        self.packed = packed
        self.embed = _param(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        self.layers = nn.ModuleList(_Layer(config, device, dtype, packed) for _ in range(config.num_layers))
        self.norm = _param(config.hidden_size, device=device, dtype=dtype)
        self.lm_head = (
            None
            if config.tie_word_embeddings or packed
            else _param(config.vocab_size, config.hidden_size, device=device, dtype=dtype)
        )
        self.packed_head = None
        inv_freq = rope_inv_freq(config)
        pos = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        self.register_buffer("rope_cos", freqs.cos().to(device=device, dtype=dtype), persistent=False)
        self.register_buffer("rope_sin", freqs.sin().to(device=device, dtype=dtype), persistent=False)

    def _blocks(self) -> list[_Layer]:
        return cast(list[_Layer], list(self.layers))

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.embed.device

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        keep_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Run the new tokens of a batch through the decoder, caching their K/V.

        Returns the final-norm hidden states ``[N, hidden]``; feed the rows you need to
        :meth:`compute_logits`. With ``keep_rows`` (indices into the N rows), only those rows are
        returned, in that order; on the native path the last layer then runs its output
        projection and MLP for them alone (the other rows only need their K/V there), which leaves
        the kept rows' bits unchanged since every row is computed on its own.
        """
        if self.packed:
            with thread_budget():
                return self._forward(input_ids, positions, meta, kv_cache, keep_rows)
        return self._forward(input_ids, positions, meta, kv_cache, keep_rows)

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: KVCache,
        keep_rows: Sequence[int] | None = None,
    ) -> torch.Tensor:
        c = self.config
        n = int(input_ids.shape[0])
        plan = plan_attention(meta, n, kv_cache.num_slots, self.device, native_decode=self.packed)
        if n and int(positions.max()) >= c.max_position_embeddings:
            raise EngineError(
                f"position {int(positions.max())} is beyond the model's {c.max_position_embeddings}-token context"
            )
        # the packed kernel is batch invariant for any row count; MKL needs multiples of 4
        rows = n if self.packed else _pad_rows(n)
        ids = input_ids.to(self.device)
        pos = positions.to(self.device)
        if rows > n:
            ids = torch.cat((ids, ids.new_zeros(rows - n)))
            pos = torch.cat((pos, pos.new_zeros(rows - n)))
        # packed models rotate q/k in place natively (same bits as rotate_half, without its ~14 us of
        # torch calls per layer); the tables are indexed per row there
        native_rope = self.packed and native_rope_ok(self.rope_cos, self.rope_sin, pos, c.head_dim)
        if not native_rope:
            cos = self.rope_cos[pos].unsqueeze(1)
            sin = self.rope_sin[pos].unsqueeze(1)
        heads, kv_heads, dim, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        qk_heads = heads + kv_heads
        x = F.embedding(ids, self.embed)
        blocks = self._blocks()
        # Row pruning needs row-count-independent linears (the native kernel); torch's are padded.
        prune = keep_rows is not None and self.packed and len(keep_rows) < n
        for i, layer in enumerate(blocks):
            qkv = _norm_linear(x, layer.input_norm, eps, layer.qkv, layer.qkv_bias)
            if native_rope:
                qk = qkv[:, : qk_heads * dim].view(rows, qk_heads, dim)
                rope_in_place(qkv, qk_heads, dim, self.rope_cos, self.rope_sin, pos)
            else:
                qk = rotate_half(qkv[:, : qk_heads * dim].view(rows, qk_heads, dim), cos, sin)
            v = qkv[:, qk_heads * dim :].view(rows, kv_heads, dim)
            k_cache, v_cache = kv_cache.flat(i)
            attn = paged_attention(qk[:, :heads], qk[:, heads:], v, k_cache, v_cache, plan)
            if prune and i == len(blocks) - 1:
                assert keep_rows is not None
                index = torch.tensor(list(keep_rows), dtype=torch.int64, device=x.device)
                x, attn = x.index_select(0, index), attn.index_select(0, index)
            x = x + _linear(attn, layer.o)
            gate, up = _norm_linear(x, layer.post_norm, eps, layer.gate_up).chunk(2, dim=-1)
            x = x + _linear(F.silu(gate) * up, layer.down)
        x = F.rms_norm(x, (c.hidden_size,), self.norm, eps)
        if prune:
            return x
        if keep_rows is not None:
            return x.index_select(0, torch.tensor(list(keep_rows), dtype=torch.int64, device=x.device))
        return x[:n]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
        """Project hidden states ``[M, hidden]`` to float32 logits ``[M, vocab]`` (batch invariant).

        ``allowed`` (int32 token bitmask ``[M, words]``, e.g. a grammar's) lets the packed head skip
        the weights of tokens no row can take: those logits come back ``-inf`` and every other one
        is bit-identical. Paths without the packed head ignore it (the caller masks anyway).
        """
        if self.packed_head is not None:
            with thread_budget():
                if allowed is not None and self.packed_head.bias is None:
                    return self.packed_head.forward_allowed(hidden.float(), allowed)
                return self.packed_head(hidden.float())
        m = int(hidden.shape[0])
        rows = _pad_rows(m)
        if rows > m:
            hidden = torch.cat((hidden, hidden.new_zeros(rows - m, hidden.shape[1])))
        weight = self.embed if self.lm_head is None else self.lm_head
        return _in_row_chunks(lambda h: F.linear(h.to(weight.dtype), weight), hidden)[:m].float()

    def _targets(self) -> dict[str, tuple[torch.Tensor, int]]:
        """HF tensor name -> (destination parameter, first row inside it)."""
        c = self.config
        t: dict[str, tuple[torch.Tensor, int]] = {
            "model.embed_tokens.weight": (self.embed, 0),
            "model.norm.weight": (self.norm, 0),
        }
        if self.lm_head is not None:
            t["lm_head.weight"] = (self.lm_head, 0)
        for i, layer in enumerate(self._blocks()):
            p = f"model.layers.{i}."
            t[p + "input_layernorm.weight"] = (layer.input_norm, 0)
            t[p + "post_attention_layernorm.weight"] = (layer.post_norm, 0)
            if not self.packed:
                assert isinstance(layer.o, nn.Parameter) and isinstance(layer.down, nn.Parameter)
                assert isinstance(layer.gate_up, nn.Parameter) and isinstance(layer.qkv, nn.Parameter)
                t[p + "self_attn.o_proj.weight"] = (layer.o, 0)
                t[p + "mlp.down_proj.weight"] = (layer.down, 0)
                t[p + "mlp.gate_proj.weight"] = (layer.gate_up, 0)
                t[p + "mlp.up_proj.weight"] = (layer.gate_up, c.intermediate_size)
            for name, off in (("q", 0), ("k", c.q_size), ("v", c.q_size + c.kv_size)):
                if not self.packed:
                    t[p + f"self_attn.{name}_proj.weight"] = (cast(torch.Tensor, layer.qkv), off)
                if layer.qkv_bias is not None:
                    t[p + f"self_attn.{name}_proj.bias"] = (layer.qkv_bias, off)
        return t

    def _expected_shape(self, name: str, dest: torch.Tensor) -> tuple[int, ...]:
        c = self.config
        rows = {
            "q_proj": c.q_size,
            "k_proj": c.kv_size,
            "v_proj": c.kv_size,
            "gate_proj": c.intermediate_size,
            "up_proj": c.intermediate_size,
        }
        for key, r in rows.items():
            if f".{key}." in name:
                return (r, *dest.shape[1:])
        return tuple(dest.shape)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model (dtype converted); every weight must appear exactly once.

        Raises :class:`ModelLoadError` naming any missing, unexpected, duplicated or mis-shaped tensor.
        """
        targets = self._targets()
        seen: set[str] = set()
        for name, tensor in named_tensors:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name == "lm_head.weight" and self.lm_head is None and not self.packed:
                continue  # tied embeddings: some checkpoints still store the (identical) head
            if name not in targets:
                raise ModelLoadError(f"unexpected tensor {name!r} for a {self.config.architecture} model")
            if name in seen:
                raise ModelLoadError(f"tensor {name!r} appears twice")
            dest, off = targets[name]
            shape = self._expected_shape(name, dest)
            if tuple(tensor.shape) != shape:
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
            dest[off : off + shape[0]].copy_(tensor)
            seen.add(name)
        missing = sorted(set(targets) - seen)
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ModelLoadError(f"missing tensors: {', '.join(missing[:5])}{more}")

    def packed_weight_names(self) -> frozenset[str]:
        """HF names of the tensors :meth:`load_packed_gguf` provides (empty unless packed)."""
        if not self.packed:
            return frozenset()
        names = {"lm_head.weight"}
        for i in range(self.config.num_layers):
            for hf_names in _PACKED_PROJECTIONS.values():
                names.update(f"model.layers.{i}.{n}" for n in hf_names)
        return frozenset(names)

    @torch.no_grad()
    def load_packed_gguf(self, f: GGUFFile) -> None:
        """Pack the projections and LM head straight from the GGUF's quantized bytes (packed models only).

        q/k rows of Llama files are un-permuted like :func:`gguf_loader.gguf_weights` does; a fused
        projection whose parts have different ggml types is packed from exact float32 values.
        """
        if not self.packed:
            raise EngineError("load_packed_gguf needs a model built with packed=True")
        c = self.config
        q8 = envs.linear_activations() == "q8"
        heads = {"attn_q.weight": c.num_heads, "attn_k.weight": c.num_kv_heads}
        for i, layer in enumerate(self._blocks()):
            for attr, gguf_names in _GGUF_PROJECTIONS.items():
                names = [f"blk.{i}.{n}" for n in gguf_names]
                types = {f.tensors[n].ggml_type for n in names if n in f.tensors}
                parts = [
                    gguf_rows(
                        f,
                        full,
                        heads.get(short) if c.architecture == "llama" else None,
                        force_f32=len(types) > 1,
                    )
                    for short, full in zip(gguf_names, names)
                ]
                k = self._in_features(attr)
                for n in names:
                    if n in f.tensors and f.tensors[n].shape[-1] != k:
                        raise ModelLoadError(
                            f"{f.path}: tensor {n!r} has shape {f.tensors[n].shape}, expected K={k}"
                        )
                setattr(layer, attr, QuantLinear.from_rows(parts, k, q8_activations=q8))
        head = "output.weight" if "output.weight" in f.tensors else "token_embd.weight"
        if f.tensors[head].shape != (c.vocab_size, c.hidden_size):
            raise ModelLoadError(
                f"{f.path}: tensor {head!r} has shape {f.tensors[head].shape}, expected {(c.vocab_size, c.hidden_size)}"
            )
        self.packed_head = QuantLinear.from_rows([gguf_rows(f, head)], c.hidden_size, q8_activations=q8)

    def _in_features(self, attr: str) -> int:
        c = self.config
        return {"qkv": c.hidden_size, "o": c.q_size, "gate_up": c.hidden_size, "down": c.intermediate_size}[
            attr
        ]
