"""The DeepSeek kernels of the C++ extension (engine_native/src/kernels/): MoE router and experts,
V4 decode attention, window closes, hyper-connections, V4 RoPE, grouped projections (V3's MLA
kernels are in :mod:`.native_mla`).

Part of the model's door to the extension (:mod:`.native_ops` holds the generic kernels, the
thread budget and :func:`~.native_ops.extension`). Hot entry points take raw addresses, so every
wrapper documents, and checks where it is cheap, the shapes and dtypes the kernel relies on.
"""

from __future__ import annotations

from typing import Protocol

import torch

from agent_infer.model.layers.native_ops import PackedWeight, extension, get_num_threads, threads_for

# --- MoE ---------------------------------------------------------------------------------------


class PackedExpertSet(Protocol):
    """What ``_native.PackedExperts`` offers: a MoE layer's experts over packed weights."""

    num_experts: int
    hidden: int

    def forward(
        self, x: int, t: int, experts: int, weights: int, k: int, out: int, limit: float, num_threads: int = 1
    ) -> None:
        """``out`` = the layer's routed (then shared) expert sum per token, on raw addresses."""
        ...

    def forward_routed(
        self, router: PackedRouterSet, x: int, t: int, fixed: int, out: int, limit: float, num_threads: int = 1,
        norm: int = 0, eps: float = 0.0, ldx: int = 0,
    ) -> None:  # fmt: skip
        """:meth:`forward` over ``router``'s choice for ``x`` (``fixed``: hash-routed experts or 0),
        its rows first RMS-normalized with the weights at ``norm`` when nonzero."""
        ...


class PackedRouterSet(Protocol):
    """What ``_native.PackedRouter`` offers: a MoE layer's router over a packed gate."""

    num_experts: int
    top_k: int

    def route(self, x: int, t: int, fixed: int, experts: int, weights: int) -> None:
        """Experts ``[t, k]`` (int64) and weights ``[t, k]`` (float32) of ``x`` ``[t, H]``, raw addresses."""
        ...


def packed_router(
    gate: PackedWeight, scoring: str, bias: list[float] | None, groups: int, topk_groups: int, top_k: int,
    renormalize: bool, scaling: float,
) -> PackedRouterSet:  # fmt: skip
    """A MoE router over the packed ``gate`` ``[E, H]`` (engine_native/src/kernels/linear_router.h)."""
    router: PackedRouterSet = extension().PackedRouter(
        gate, scoring, bias or [], groups, topk_groups, top_k, renormalize, scaling
    )
    return router


def _rows(x: torch.Tensor, width: int, what: str) -> torch.Tensor:
    x = x.to(device="cpu", dtype=torch.float32).contiguous()
    if x.dim() != 2 or int(x.shape[1]) != width:
        raise ValueError(f"{what}: x has shape {tuple(x.shape)}, expected [tokens, {width}]")
    return x


def _fixed(fixed: torch.Tensor | None, t: int, k: int, what: str) -> torch.Tensor | None:
    if fixed is None:
        return None
    fixed = fixed.to(device="cpu", dtype=torch.int64).contiguous()
    if tuple(fixed.shape) != (t, k):
        raise ValueError(f"{what}: fixed experts have shape {tuple(fixed.shape)}, expected {(t, k)}")
    return fixed


def route_packed(
    router: PackedRouterSet, x: torch.Tensor, fixed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts ``[T, k]`` (int64) and float32 weights of ``x`` ``[T, H]`` (``fixed``: hash-routed experts)."""
    x = _rows(x, int(x.shape[-1]), "route_packed")
    t, k = int(x.shape[0]), router.top_k
    fixed = _fixed(fixed, t, k, "route_packed")
    experts = torch.empty(t, k, dtype=torch.int64)
    weights = torch.empty(t, k)
    router.route(
        x.data_ptr(), t, 0 if fixed is None else fixed.data_ptr(), experts.data_ptr(), weights.data_ptr()
    )
    return experts, weights


def run_routed_experts(
    packed: PackedExpertSet,
    router: PackedRouterSet,
    x: torch.Tensor,
    fixed: torch.Tensor | None,
    limit: float | None,
    norm: tuple[torch.Tensor, float] | None = None,
    row_work: int = 0,
) -> torch.Tensor:
    """Float32 ``[T, H]``: :func:`run_experts` over the experts and weights ``router`` picks for ``x``,
    or for ``rms_norm(x) * weight`` with ``norm`` = ``(weight, eps)`` (then ``x``'s rows may lie
    apart: a row slice of a wider tensor is read in place). ``row_work``: multiply-adds per token
    (router and experts), for :func:`threads_for`; 0 takes the pool's thread count."""
    ldx = 0
    if (
        norm is not None
        and _normable(x, packed.hidden)
        and norm[0].dtype is torch.float32
        and norm[0].is_contiguous()
    ):
        ldx = int(x.stride(0))
    else:
        if norm is not None:
            x = torch.nn.functional.rms_norm(x, (int(x.shape[-1]),), norm[0], norm[1])
            norm = None
        x = _rows(x, packed.hidden, "run_routed_experts")
    t = int(x.shape[0])
    fixed = _fixed(fixed, t, router.top_k, "run_routed_experts")
    out = torch.empty(t, packed.hidden, dtype=torch.float32)
    packed.forward_routed(
        router, x.data_ptr(), t, 0 if fixed is None else fixed.data_ptr(), out.data_ptr(),
        float("nan") if limit is None else float(limit), threads_for(t * row_work) if row_work else get_num_threads(),
        0 if norm is None else norm[0].data_ptr(), 0.0 if norm is None else float(norm[1]), ldx,
    )  # fmt: skip
    return out


def normed_rows(x: torch.Tensor, width: int, norm: tuple[torch.Tensor, float]) -> torch.Tensor:
    """Float32 ``rms_norm(x) * weight`` (``norm`` = ``(weight, eps)``) with the bits
    :func:`run_routed_experts` routes on: the native fused norm where it takes ``x``, else torch's.
    An expert-parallel rank normalizes here, then routes and sends the rows."""
    weight, eps = norm
    if _normable(x, width) and weight.dtype is torch.float32 and weight.is_contiguous():
        t = int(x.shape[0])
        out = torch.empty(t, width, dtype=torch.float32)
        extension().rms_norm_rows(
            x.data_ptr(), t, width, int(x.stride(0)), weight.data_ptr(), float(eps), out.data_ptr()
        )
        return out
    x = torch.nn.functional.rms_norm(x, (int(x.shape[-1]),), weight, eps)
    return _rows(x, width, "normed_rows")


def _normable(x: torch.Tensor, width: int) -> bool:
    """Float32 CPU rows of ``width`` contiguous values each, possibly apart (the fused norm reads them)."""
    return (
        x.dtype is torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
        and int(x.shape[1]) == width
        and x.stride(1) == 1
        and int(x.stride(0)) >= width
    )


def packed_experts(
    gate_up: list[PackedWeight],
    down: list[PackedWeight],
    shared_gate_up: PackedWeight | None,
    shared_down: PackedWeight | None,
) -> PackedExpertSet:
    """One MoE layer's experts (``gate_up[e]`` ``[2I, H]``, ``down[e]`` ``[H, I]``) for :func:`run_experts`."""
    experts: PackedExpertSet = extension().PackedExperts(gate_up, down, shared_gate_up, shared_down)
    return experts


def run_experts(
    packed: PackedExpertSet,
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    limit: float | None,
) -> torch.Tensor:
    """Float32 ``[T, H]``: per token of ``x`` ``[T, H]``, the sum over its ``experts`` ``[T, k]`` of
    ``weights`` ``[T, k]`` times the expert's SwiGLU (clamped at ``limit`` when set), in ascending
    expert order, plus the shared experts. Inputs are converted to the kernel's dtypes here."""
    x = x.to(device="cpu", dtype=torch.float32).contiguous()
    experts = experts.to(device="cpu", dtype=torch.int64).contiguous()
    weights = weights.to(device="cpu", dtype=torch.float32).contiguous()
    t, k = int(experts.shape[0]), int(experts.shape[1]) if experts.dim() == 2 else 0
    if (
        x.dim() != 2
        or int(x.shape[0]) != t
        or int(x.shape[1]) != packed.hidden
        or tuple(weights.shape) != (t, k)
    ):
        raise ValueError(
            f"run_experts: x {tuple(x.shape)}, experts {tuple(experts.shape)} and weights "
            f"{tuple(weights.shape)} do not describe {t} tokens of width {packed.hidden}"
        )
    out = torch.empty(t, packed.hidden, dtype=torch.float32)
    packed.forward(
        x.data_ptr(), t, experts.data_ptr(), weights.data_ptr(), k, out.data_ptr(),
        float("nan") if limit is None else float(limit), get_num_threads(),
    )  # fmt: skip
    return out


def rope_pairs(
    x: torch.Tensor, rows: int, heads: int, dim: int, rope_dim: int, cos: torch.Tensor, sin: torch.Tensor,
    inverse: bool, norm: int, weight: torch.Tensor | None, eps: float,
) -> None:  # fmt: skip
    """DeepSeek V4's interleaved rotation of each head's trailing ``rope_dim`` values, in place on
    contiguous float32 CPU ``x`` (``[rows, heads, dim]`` or ``[rows, dim]``) by per-row ``cos``/``sin``
    ``[rows, rope_dim]``; ``norm`` 1 or 2 first RMS-normalizes each head (2: times ``weight``)."""
    if int(cos.shape[0]) < rows or int(cos.shape[1]) != rope_dim or cos.shape != sin.shape:
        raise ValueError(
            f"rope_pairs: tables {tuple(cos.shape)} for {rows} rows of {rope_dim} rotated values"
        )
    if weight is not None and (int(weight.numel()) != dim or not weight.is_contiguous()):
        raise ValueError(f"rope_pairs: a norm weight of {int(weight.numel())} values for heads of {dim}")
    extension().rope_pairs_rows(
        x.data_ptr(), rows, heads * dim, heads, dim, dim, rope_dim, cos.data_ptr(), sin.data_ptr(), inverse, norm,
        0 if weight is None else weight.data_ptr(), eps,
    )  # fmt: skip


# --- DeepSeek V4 decode attention ---------------------------------------------------------------


class V4DecodeBatch(Protocol):
    """What ``_native.V4DecodeBatch`` offers: a step's decode rows at one compression rate."""

    size: int

    def run(
        self, q: int, window: int, entries: int, sinks: int, out: int, heads: int, dim: int, entry_width: int,
        scale: float, iq: int, iq_row: int, iw: int, iw_row: int, index_heads: int, index_dim: int,
        index_topk: int, score_scale: float, weight_scale: float, num_threads: int = 1,
    ) -> None:  # fmt: skip
        """Attend every row on raw float32 addresses (engine_native/src/kernels/attention_v4.cpp)."""
        ...


def v4_decode_batch(
    rows: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor, block_size: int, window: int, rate: int,
    num_rows: int, num_slots: int,
) -> V4DecodeBatch:  # fmt: skip
    """A step's decode rows at one compression rate (0: sliding window only), their window and entry
    slots derived from the block tables and checked once for every layer of the rate."""
    batch: V4DecodeBatch = extension().V4DecodeBatch(
        rows.contiguous(),
        tables.contiguous(),
        ctx.contiguous(),
        block_size,
        window,
        rate,
        num_rows,
        num_slots,
    )
    return batch


def close_windows(*args: object, work: int = 0) -> None:
    """DeepSeek V4's compressor for the windows decode rows complete, on raw addresses (see
    ``engine_native/src/kernels/compressor.cpp`` and layers/compressed_native.py, its one caller);
    ``work``: the call's multiply-adds for :func:`threads_for` (0: the pool's thread count)."""
    extension().close_windows(*args, threads_for(work) if work else get_num_threads())


# --- hyper-connections (DeepSeek V4) ----------------------------------------------------------


def _hc_inputs(streams: torch.Tensor, *params: tuple[torch.Tensor, tuple[int, ...]]) -> torch.Tensor:
    """``streams`` as contiguous float32 CPU ``[R, hc, H]``; each parameter checked against its shape."""
    streams = streams.contiguous()
    if streams.dtype is not torch.float32 or streams.device.type != "cpu" or streams.dim() != 3:
        raise ValueError(
            f"hyper_connections: streams {tuple(streams.shape)} {streams.dtype} are not float32 CPU [R, hc, H]"
        )
    for t, shape in params:
        if (
            t.dtype is not torch.float32
            or t.device.type != "cpu"
            or not t.is_contiguous()
            or tuple(t.shape) != shape
        ):
            raise ValueError(
                f"hyper_connections: a weight {tuple(t.shape)} {t.dtype} is not float32 CPU {shape}"
            )
    return streams


def hc_collapse(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, hc_eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(post [R, hc], comb [R, hc, hc], collapsed [R, H])`` of float32 CPU ``streams`` ``[R, hc, H]``,
    row by row (engine_native/src/kernels/hyper.cpp)."""
    rows, hc, hidden = (int(d) for d in streams.shape)
    width = (2 + hc) * hc
    streams = _hc_inputs(streams, (fn, (width, hc * hidden)), (base, (width,)), (scale, (3,)))
    post = torch.empty(rows, hc)
    comb = torch.empty(rows, hc, hc)
    collapsed = torch.empty(rows, hidden)
    extension().hc_collapse(
        streams.data_ptr(), rows, hc, hidden, fn.data_ptr(), base.data_ptr(), scale.data_ptr(), iters, hc_eps,
        norm_eps, post.data_ptr(), comb.data_ptr(), collapsed.data_ptr(), threads_for(rows * width * hc * hidden),
    )  # fmt: skip
    return post, comb, collapsed


def hc_expand(
    post: torch.Tensor, comb: torch.Tensor, output: torch.Tensor, streams: torch.Tensor
) -> torch.Tensor:
    """New float32 streams ``post * output + comb^T @ streams`` (``[R, hc, H]``), row by row."""
    rows, hc, hidden = (int(d) for d in streams.shape)
    post, comb, output = post.contiguous(), comb.contiguous(), output.contiguous()
    streams = _hc_inputs(streams, (post, (rows, hc)), (comb, (rows, hc, hc)), (output, (rows, hidden)))
    out = torch.empty(rows, hc, hidden)
    extension().hc_expand(
        post.data_ptr(), comb.data_ptr(), output.data_ptr(), streams.data_ptr(), out.data_ptr(), rows, hc, hidden,
        threads_for(rows * (hc + 1) * hc * hidden),
    )  # fmt: skip
    return out


def hc_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """The final collapse ``[R, H]`` of float32 CPU ``streams`` ``[R, hc, H]``, row by row."""
    rows, hc, hidden = (int(d) for d in streams.shape)
    streams = _hc_inputs(streams, (fn, (hc, hc * hidden)), (base, (hc,)), (scale, (1,)))
    out = torch.empty(rows, hidden)
    extension().hc_head(
        streams.data_ptr(), rows, hc, hidden, fn.data_ptr(), base.data_ptr(), scale.data_ptr(), hc_eps, norm_eps,
        out.data_ptr(), threads_for(rows * (hc + 1) * hc * hidden),
    )  # fmt: skip
    return out


# --- grouped projection (DeepSeek V4 wo_a) ----------------------------------------------------


def grouped_linear(packs: list[PackedWeight], x: torch.Tensor) -> torch.Tensor:
    """Float32 ``[M, G * N]``: group ``g`` of ``x`` (``[M, G * K]`` float32 CPU, the ``K`` columns
    from ``g * K``) through ``packs[g]`` (``[N, K]`` each), read and written in place by stride."""
    x = x.contiguous()
    groups = len(packs)
    m, k, n = int(x.shape[0]), packs[0].k, packs[0].n
    if (
        x.dtype is not torch.float32
        or x.device.type != "cpu"
        or x.dim() != 2
        or int(x.shape[1]) != groups * k
    ):
        raise ValueError(
            f"grouped_linear: x {tuple(x.shape)} {x.dtype} is not [rows, {groups} x {k}] float32 CPU"
        )
    if any(p.k != k or p.n != n for p in packs):
        raise ValueError("grouped_linear: the groups' weights differ in shape")
    out = torch.empty(m, groups * n)
    threads = threads_for(m * k * n)
    for g, p in enumerate(packs):
        p.forward_raw(
            x.data_ptr() + 4 * g * k, m, out.data_ptr() + 4 * g * n, threads, groups * k, groups * n
        )
    return out
