"""The Triton backend (NVIDIA; also runs in Triton's CPU interpreter with ``TRITON_INTERPRET=1``).

One program per (row, block of ``_WORDS`` bitmask words): it loads the words once, expands them to
a ``[_WORDS, 32]`` tile of allow bits and stores ``-inf`` only where a bit is clear, so allowed
logits are never read or written. float32, float16 and bfloat16 logits; bitmask and indices on the
logits' device. Importing this module imports triton; :func:`agent_infer.grammar.runtime.kernels.available`
checks that triton is installed before it does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NAME = "triton"

# 16 words = 512 tokens per program: 96 programs per row at a 49k vocabulary, enough to fill a GPU
# at batch 1 while keeping per-program overhead small at batch 64.
_WORDS = 16
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _apply_token_bitmask_kernel(  # type: ignore[no-untyped-def]
    logits_ptr,
    bitmask_ptr,
    indices_ptr,
    num_rows,
    vocab,
    num_words,
    logits_stride,
    mask_stride,
    HAS_INDICES: tl.constexpr,
    WORDS: tl.constexpr,
):
    # Parameters are unannotated on purpose: Triton reads annotations as type specialisations.
    slot = tl.program_id(0).to(tl.int64)
    if HAS_INDICES:
        row = tl.load(indices_ptr + slot).to(tl.int64)
    else:
        row = slot
    # Device-resident indices are not range-checked on the host (that would sync); skip bad rows.
    if (row >= 0) & (row < num_rows):
        words_at = tl.program_id(1) * WORDS + tl.arange(0, WORDS)
        words = tl.load(bitmask_ptr + row * mask_stride + words_at, mask=words_at < num_words, other=0)
        bit = tl.arange(0, 32)
        allowed = ((words[:, None] >> bit[None, :]) & 1) != 0
        token = words_at[:, None] * 32 + bit[None, :]
        neg_inf = tl.full([WORDS, 32], float("-inf"), logits_ptr.dtype.element_ty)
        tl.store(logits_ptr + row * logits_stride + token, neg_inf, mask=(token < vocab) & ~allowed)


def is_available(device: torch.device) -> bool:
    """True for CUDA tensors (triton itself is importable, or this module would not be)."""
    return device.type == "cuda"


def supports(logits: torch.Tensor) -> bool:
    """float32 / float16 / bfloat16 logits with unit stride in the vocabulary dimension."""
    return logits.dtype in _DTYPES and logits.stride(-1) == 1


def apply(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor | None) -> None:
    """Set disallowed logits to ``-inf`` in place with one Triton launch."""
    slots = logits.shape[0] if indices is None else indices.numel()
    vocab = logits.shape[1]
    if slots == 0 or vocab == 0:
        return
    grid = (slots, triton.cdiv(triton.cdiv(vocab, 32), _WORDS))
    args = (
        logits,
        bitmask,
        bitmask if indices is None else indices,  # never read without indices: HAS_INDICES is constexpr
        min(logits.shape[0], bitmask.shape[0]),
        vocab,
        bitmask.shape[1],
        logits.stride(0),
        bitmask.stride(0),
    )
    if logits.device.type == "cuda" and logits.device.index not in (None, torch.cuda.current_device()):
        # Triton launches on the current device; follow the tensors on a multi-GPU machine.
        with torch.cuda.device(logits.device):
            _apply_token_bitmask_kernel[grid](*args, HAS_INDICES=indices is not None, WORDS=_WORDS)
        return
    _apply_token_bitmask_kernel[grid](*args, HAS_INDICES=indices is not None, WORDS=_WORDS)
