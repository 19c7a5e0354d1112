"""An expert-parallel rank's slots of one MoE layer on the native expert kernel.

When the one-process model runs a MoE layer on the packed native kernel
(:meth:`~agent_infer.model.layers.moe.MoE.pack_experts`), a rank that hosts some of its experts
runs them on that kernel too: a ``PackedExperts`` over the rank's slots (slot ``j`` is its expert
``j``) and one over the layer's shared experts. Each received pair is one row with weight 1, so the
kernel's ``0 + output * 1`` is the expert's output row exactly, and the kernel's rows do not depend
on each other; the token's owner then adds ``weight * output`` in the one-process order.

A rebalance keeps the packed weights of every expert the rank already held and packs only the
slots that receive an expert new to the rank.
"""

from __future__ import annotations

import torch

from agent_infer.model.layers import native_deepseek
from agent_infer.model.layers.float_linear import pack_float32
from agent_infer.model.layers.moe import MoE
from agent_infer.model.layers.native_ops import PackedWeight

_Pair = tuple[PackedWeight, PackedWeight]


class NativeSlots:
    """One layer's slots and shared experts of one rank, packed."""

    def __init__(self, moe: MoE) -> None:
        self.limit = moe.swiglu_limit
        self.slots: native_deepseek.PackedExpertSet | None = None
        self.shared: native_deepseek.PackedExpertSet | None = None
        if moe.shared_gate_up is not None and moe.shared_down is not None:
            self.shared = native_deepseek.packed_experts(
                [pack_float32(moe.shared_gate_up)], [pack_float32(moe.shared_down)], None, None
            )
        self._pairs: list[_Pair] = []
        self._experts: tuple[int, ...] = ()

    def pack(self, experts: tuple[int, ...], gate_up: torch.Tensor, down: torch.Tensor) -> int:
        """Slots holding ``experts`` (weights ``gate_up`` ``[S, 2I, H]``, ``down`` ``[S, H, I]``);
        the number of slots packed (those whose expert was not held before)."""
        held = dict(zip(self._experts, self._pairs))
        pairs: list[_Pair] = []
        packed = 0
        for j, e in enumerate(experts):
            pair = held.get(e)
            if pair is None:
                pair = (pack_float32(gate_up[j]), pack_float32(down[j]))
                packed += 1
            pairs.append(pair)
        self._pairs, self._experts = pairs, tuple(experts)
        self.slots = native_deepseek.packed_experts([p[0] for p in pairs], [p[1] for p in pairs], None, None)
        return packed

    def run(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Float32 ``[P, H]``: row ``i`` through the expert of slot ``slots[i]``."""
        assert self.slots is not None, "pack() runs first"
        ones = torch.ones(int(slots.shape[0]), 1)
        return native_deepseek.run_experts(self.slots, rows, slots[:, None], ones, self.limit)

    def run_shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """Float32 ``[T, H]``: the shared experts of ``x``'s rows (None without shared experts)."""
        if self.shared is None:
            return None
        tokens = int(x.shape[0])
        zeros, ones = torch.zeros(tokens, 1, dtype=torch.int64), torch.ones(tokens, 1)
        return native_deepseek.run_experts(self.shared, x, zeros, ones, self.limit)
