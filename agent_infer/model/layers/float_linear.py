"""Float weights of a Hugging Face checkpoint, packed at load for the native row-independent kernel.

A safetensors folder is loaded by name into torch tensors; :class:`FloatPackedLinear` takes its
weights that way (its :meth:`~FloatPackedLinear.load_targets` are a torch layer's), and
:func:`pack_loaded` then repacks every such layer into the native kernel's float32 format
(``engine_native/src/kernels/linear.cpp``, ggml type F32: the stored values, widened exactly) and
drops the torch copy, unless it is shared with the embedding. From then on a projection is one
kernel call whose every output element is a fixed FMA chain over ``k``: a row's bits do not depend
on how many rows share the call, so a 16-row decode step reads each weight (and the vocabulary-wide
head) once instead of once per 4-row chunk of the torch path (layers/linear.py).

:func:`packed_float_kernels` is the load-time choice for the families that accept it (the
registry's ``hf_packed_linears``): CPU, float32, the extension present. With these kernels the
DeepSeek families also run MoE routing and experts (:meth:`~agent_infer.model.layers.moe.MoE.pack_experts`),
decode attention, RoPE and V4's hyper-connections and grouped output projection natively, each
row in a fixed order; the few torch ops left (norms, residual adds, the embedding) keep the torch
path's 4-row padding of a forward's rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from agent_infer.errors import EngineError
from agent_infer.model.layers import native_ops
from agent_infer.model.layers.attention import PagedAttention
from agent_infer.model.layers.compressed_attention import CompressedAttention
from agent_infer.model.layers.kernels import Kernels
from agent_infer.model.layers.linear import ROW_MULTIPLE, Linear, WeightPart
from agent_infer.model.layers.moe import MoE
from agent_infer.model.layers.qlinear import F32, QuantLinear
from agent_infer.model.layers.rotary import NativeRotaryEmbedding

PACKED_FLOAT = "packed-float"


class _Unpacked:
    """Stands in for the native weight until :meth:`FloatPackedLinear.pack`: any use is a typed error."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, attr: str) -> object:
        raise EngineError(
            f"projection {self.name!r} was used before its weights were loaded and packed "
            "(agent_infer.model.layers.float_linear.pack_loaded)"
        )


def pack_float32(weight: torch.Tensor) -> native_ops.PackedWeight:
    """``weight`` ``[N, K]`` (any float dtype, converted to float32 exactly or by rounding) packed
    for the native kernel."""
    w = weight.detach().to(device="cpu", dtype=torch.float32).contiguous()
    n, k = int(w.shape[0]), int(w.shape[1])
    return native_ops.packed_linear(w.reshape(-1).view(torch.uint8), F32, n, k, q8_activations=False)


class FloatPackedLinear(QuantLinear):
    """A projection fused from ``parts`` (stacked along the output rows), loaded as float32 torch
    rows and run by the native kernel once :meth:`pack` has repacked them."""

    def __init__(
        self,
        parts: Sequence[WeightPart],
        in_features: int,
        *,
        bias: bool,
        weight: nn.Parameter | None = None,
    ) -> None:
        """``weight``: an existing float32 parameter to share (a head tied to the embedding)."""
        nn.Module.__init__(self)
        self.parts = tuple(parts)
        self.in_features = in_features
        self.out_features = sum(p.rows for p in self.parts)
        self.shared = weight is not None
        self.weight: nn.Parameter | None = (
            weight
            if weight is not None
            else nn.Parameter(torch.empty(self.out_features, in_features), requires_grad=False)
        )
        self.bias = nn.Parameter(torch.empty(self.out_features), requires_grad=False) if bias else None
        self.packed = _Unpacked(self.parts[0].name if self.parts else "?")  # type: ignore[assignment]

    def _threads(self, m: int) -> int:
        """One thread for a small call (see ``native_ops.threads_for``), the pool's count otherwise."""
        return native_ops.threads_for(m * self.in_features * self.out_features)

    def pack(self, *, keep_weight: bool = False) -> None:
        """Repack the loaded weight for the kernel and drop the torch copy (kept when shared, or
        when ``keep_weight``: another reader needs the rows, such as MTP draft heads)."""
        if self.weight is None:
            raise EngineError(f"projection {self.parts[0].name!r} is packed already")
        self.packed = pack_float32(self.weight)
        if not self.shared and not keep_weight:
            self.weight = None

    def load_targets(self) -> dict[str, tuple[torch.Tensor, int, tuple[int, ...]]]:
        """The weight rows of every part (unless shared or packed) and the bias rows, by HF name."""
        targets: dict[str, tuple[torch.Tensor, int, tuple[int, ...]]] = {}
        row = 0
        for p in self.parts:
            if self.weight is not None and not self.shared:
                targets[p.name] = (self.weight, row, (p.rows, self.in_features))
            if self.bias is not None:
                targets[p.name.removesuffix(".weight") + ".bias"] = (self.bias, row, (p.rows,))
            row += p.rows
        return targets

    def packed_names(self) -> frozenset[str]:
        """None: every tensor is read by name, then packed."""
        return frozenset()

    def extra_repr(self) -> str:
        state = "loading" if isinstance(self.packed, _Unpacked) else "packed"
        return f"in_features={self.in_features}, out_features={self.out_features}, float32, {state}"


class FloatPackedLinears:
    """Builds :class:`FloatPackedLinear` layers (float32, CPU) for :func:`pack_loaded` to pack."""

    def linear(self, parts: Sequence[WeightPart], in_features: int, *, bias: bool = False) -> Linear:
        """An empty projection, filled by name, then packed."""
        return FloatPackedLinear(parts, in_features, bias=bias)

    def head(self, name: str, rows: int, in_features: int, *, tied: nn.Parameter | None) -> Linear:
        """The LM head over its own weights, or over the embedding's when tied."""
        return FloatPackedLinear([WeightPart(name, rows)], in_features, bias=False, weight=tied)


def packed_float_kernels() -> Kernels:
    """Packed float32 projections on the native kernel, RoPE in place natively (the torch formula's
    bits); torch everywhere else, rows padded to ROW_MULTIPLE (see the module docstring); the native
    pool gets torch's threads in a forward."""
    return Kernels(
        name=PACKED_FLOAT,
        linears=FloatPackedLinears(),
        rotary=NativeRotaryEmbedding,
        attention=PagedAttention(),
        row_multiple=ROW_MULTIPLE,
        threads=native_ops.thread_budget,
    )


def _draft_read_heads(model: nn.Module) -> list[nn.Module]:
    """The heads whose torch rows MTP drafting reads (the main head of a model with MTP modules
    that lack their own): the drafter slices them to its draft vocabulary."""
    layers = getattr(model, "mtp_layers", None)
    head = getattr(model, "lm_head", None)
    if layers is None or head is None or not callable(layers):
        return []
    return [head] if any(getattr(m, "head", None) is None for m in layers()) else []


def pack_loaded(model: nn.Module, split: Sequence[MoE] = ()) -> None:
    """Pack every :class:`FloatPackedLinear`, the router and experts of every MoE and the grouped
    output projection of every DeepSeek V4 attention of a loaded model; of the MoE layers in
    ``split`` (expert parallelism: their experts live in a rank's slots) only the router."""
    kept = _draft_read_heads(model)
    for module in model.modules():
        if isinstance(module, FloatPackedLinear):
            module.pack(keep_weight=any(module is k for k in kept))
        elif isinstance(module, MoE) and any(module is m for m in split):
            module.pack_router(pack_float32)
        elif isinstance(module, MoE):
            module.pack_experts(pack_float32)
        elif isinstance(module, CompressedAttention):
            module.pack_native(pack_float32)
