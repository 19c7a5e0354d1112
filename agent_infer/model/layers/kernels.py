"""The load-time choice between the packed native path and the torch path.

A :class:`Kernels` names, for one model, the builder of its projections, the class of its rotary
embedding, its attention backend and how a forward manages threads. The loader makes it once
(:func:`native_kernels` or :func:`torch_kernels`); a family builds every layer from it and its
forward calls whatever it got, with no mode branches.

The native path needs a float32 model on the CPU and weights the packed kernel reads (GGUF); its
linears are batch invariant for any row count, so rows are neither padded nor kept past the last
layer's attention. The torch path takes any device and dtype and pads rows (layers/linear.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from agent_infer import envs
from agent_infer.model.layers import native_ops
from agent_infer.model.layers.attention import NativePagedAttention, PagedAttention
from agent_infer.model.layers.linear import ROW_MULTIPLE, LinearBuilder, TorchLinears
from agent_infer.model.layers.rotary import NativeRotaryEmbedding, RotaryEmbedding


@dataclass(frozen=True)
class Kernels:
    """The implementations one model runs with; see the module docstring."""

    name: str
    linears: LinearBuilder
    rotary: type[RotaryEmbedding]
    attention: PagedAttention
    #: Rows of a forward are padded to a multiple of this (1: no padding).
    row_multiple: int
    #: Entered around every forward and LM-head call.
    threads: Callable[[], AbstractContextManager[None]]

    @property
    def rows_independent(self) -> bool:
        """Whether a row's result is independent of the number of rows: then rows no one reads can be dropped early."""
        return self.row_multiple == 1


def native_kernels_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model on ``device``/``dtype`` can take the native path: CPU, float32, the
    extension has the model kernels, and ``AGENT_INFER_NATIVE_LINEAR`` does not turn it off."""
    return device.type == "cpu" and dtype == torch.float32 and envs.native_linear() and native_ops.available()


def native_kernels(linears: LinearBuilder) -> Kernels:
    """The packed native path over ``linears`` (a builder of packed layers)."""
    return Kernels(
        name="native",
        linears=linears,
        rotary=NativeRotaryEmbedding,
        attention=NativePagedAttention(),
        row_multiple=1,
        threads=native_ops.thread_budget,
    )


def torch_kernels(device: torch.device | None, dtype: torch.dtype) -> Kernels:
    """The torch path: empty torch weights loaded by name, SDPA, torch RoPE, padded rows."""
    return Kernels(
        name="torch",
        linears=TorchLinears(device, dtype),
        rotary=RotaryEmbedding,
        attention=PagedAttention(),
        row_multiple=ROW_MULTIPLE,
        threads=contextlib.nullcontext,
    )
