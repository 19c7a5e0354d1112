"""Dequantization of GGUF K-quants (Q2_K..Q8_K), Q5_0/Q5_1 and IQ4_NL/IQ4_XS, bit-exact with llama.cpp.

Each public function takes one tensor's raw bytes (a 1-D uint8 tensor, e.g. a view into the mapped
file) and returns float32 values, one row per block, in ggml's element order; the caller reshapes them
to the tensor's shape. Blocks are decoded with tensor operations over chunks of ~1M values, so the
intermediate codes stay in cache and in reusable heap memory while the float32 output is written once.

The arithmetic is that of ggml's ``dequantize_row_*`` reference code, as the ``gguf`` package also
computes it: integer codes are unpacked exactly, the per-sub-block factor is formed first
(``dl = d * sc``), then each value is ``dl * q`` (minus ``dmin * m``, or plus ``m``, for types with a
minimum), in float32. With fp16 scales every product is exact in float32 (at most 11 + 7 + 5
significant bits), so the only rounding is the final subtraction or addition; a build of llama.cpp that
fuses it into a multiply-add rounds the same exact operands once and gets the same bits. Q8_K's float32
scale times an int8 code is one rounded product.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import torch

_QT = gguf.GGMLQuantizationType
_Decode = Callable[[torch.Tensor, torch.Tensor], None]
_Dequantize = Callable[[torch.Tensor], torch.Tensor]
# values decoded per step: large enough to amortize the per-op overhead, small enough for L2/L3
_CHUNK_VALUES = 1 << 20
# the non-linear 4-bit code book of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl)
_IQ4_VALUES = torch.tensor(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.float32
)

# byte value -> its 8 bits as 8 bytes of one little-endian int64, low bit first: expands a bit mask
# into one byte per bit with a single gather (shift-and-mask per bit position is ~6x slower)
_BIT_BYTES = torch.tensor([sum(((v >> k) & 1) << (8 * k) for k in range(8)) for v in range(256)])

DEQUANTIZERS: dict[int, _Dequantize] = {}
"""ggml type id -> dequantizer, for the types this module adds to :mod:`gguf_reader`."""


def _register(qtype: _QT) -> Callable[[_Decode], _Dequantize]:
    """Turn ``decode(blocks, out)`` (one chunk of blocks into its float32 rows) into a whole-tensor dequantizer."""
    block_values, type_size = gguf.GGML_QUANT_SIZES[qtype]
    step = max(1, _CHUNK_VALUES // block_values)

    def wrap(decode: _Decode) -> _Dequantize:
        def dequantize(raw: torch.Tensor) -> torch.Tensor:
            blocks = raw.view(-1, type_size)
            out = torch.empty(blocks.shape[0], block_values, dtype=torch.float32)
            for i in range(0, blocks.shape[0], step):
                decode(blocks[i : i + step], out[i : i + step])
            return out

        dequantize.__name__ = dequantize.__qualname__ = decode.__name__
        dequantize.__doc__ = decode.__doc__
        DEQUANTIZERS[int(qtype)] = dequantize
        return dequantize

    return wrap


def _f16(b: torch.Tensor, start: int) -> torch.Tensor:
    # one fp16 field of every block, as a float32 column (exact)
    return b[:, start : start + 2].contiguous().view(torch.float16).float()


def _fields(x: torch.Tensor, width: int, dim: int = -2) -> torch.Tensor:
    """The ``width``-bit fields of bytes ``x``, low bits first, stacked along a new axis ``dim``.

    ``dim=-2`` puts field ``k`` of byte ``j`` at ``[k, j]`` (codes spread over runs of consecutive
    values); ``dim=-1`` at ``[j, k]`` (fields of one little-endian word, in bit order).
    """
    x = x.contiguous()
    mask = (1 << width) - 1
    parts = [x & mask]
    parts += [(x >> s) & mask for s in range(width, 8 - width, width)]
    parts.append(x >> (8 - width))
    return torch.stack(parts, dim=dim)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """The bits of the bytes ``x`` (n, k) in little-endian order, one byte each: (n, 8 * k)."""
    return _BIT_BYTES.index_select(0, x.reshape(-1).int()).view(torch.uint8).view(x.shape[0], -1)


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed in Q4_K/Q5_K's 12 bytes (ggml's ``get_scale_min_k4``)."""
    s = s.reshape(-1, 3, 4)
    lo, mid, hi = s[:, 0], s[:, 1], s[:, 2]
    scales = torch.cat((lo & 63, (hi & 15) | ((lo >> 2) & 48)), dim=1)
    mins = torch.cat((mid & 63, (hi >> 4) | ((mid >> 2) & 48)), dim=1)
    return scales.float(), mins.float()


def _scale(out: torch.Tensor, q: torch.Tensor, dl: torch.Tensor, ml: torch.Tensor | None = None) -> None:
    """``out = dl * q - ml`` per sub-block: codes ``q`` (n, subs, len), factors ``dl``/``ml`` (n, subs)."""
    y = out.view(q.shape)
    y.copy_(q)
    y.mul_(dl.unsqueeze(-1))
    if ml is not None:
        y.sub_(ml.unsqueeze(-1))


@_register(_QT.Q2_K)
def dequantize_q2_k(b: torch.Tensor, out: torch.Tensor) -> None:
    """Q2_K: 16 sub-blocks of 16, 2-bit codes, 4-bit scale and min per sub-block; ``y = d*sc*q - dmin*m``."""
    n = b.shape[0]
    sc = b[:, :16]
    # 64 code bytes = two halves of 32; byte l of a half holds value l of four consecutive 32-value runs
    q = _fields(b[:, 16:80].reshape(n, 2, 32), 2).view(n, 16, 16)
    _scale(out, q, _f16(b, 80) * (sc & 15).float(), _f16(b, 82) * (sc >> 4).float())


@_register(_QT.Q3_K)
def dequantize_q3_k(b: torch.Tensor, out: torch.Tensor) -> None:
    """Q3_K: 16 sub-blocks of 16, 3-bit codes (2 low bits + a high-bit mask), signed 6-bit scales."""
    n = b.shape[0]
    high = _fields(b[:, :32], 1).view(n, 256)
    low = _fields(b[:, 32:96].reshape(n, 2, 32), 2).view(n, 256)
    # ggml subtracts 4 where the high bit is clear: q = low - 4 * (1 - high)
    q = low.bitwise_or_(high.bitwise_left_shift_(2)).view(torch.int8).sub_(4)
    sc = b[:, 96:108]
    sc_low = _fields(sc[:, :8], 4).view(n, 16)
    sc_high = _fields(sc[:, 8:12], 2).view(n, 16)
    scales = sc_low.bitwise_or_(sc_high.bitwise_left_shift_(4)).float().sub_(32)
    _scale(out, q.view(n, 16, 16), _f16(b, 108) * scales)


@_register(_QT.Q4_K)
def dequantize_q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    """Q4_K: 8 sub-blocks of 32, 4-bit codes, 6-bit scale and min per sub-block; ``y = d*sc*q - dmin*m``."""
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    # each 32-byte run holds two sub-blocks: low nibbles, then high nibbles
    q = _fields(b[:, 16:144].reshape(n, 4, 32), 4).view(n, 8, 32)
    _scale(out, q, _f16(b, 0) * sc, _f16(b, 2) * mn)


@_register(_QT.Q5_K)
def dequantize_q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    """Q5_K: Q4_K's layout plus a fifth bit per code; bit ``s`` of high byte ``l`` belongs to sub-block ``s``."""
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    high = _fields(b[:, 16:48], 1).view(n, 8, 32)
    q = _fields(b[:, 48:176].reshape(n, 4, 32), 4).view(n, 8, 32)
    q.bitwise_or_(high.bitwise_left_shift_(4))
    _scale(out, q, _f16(b, 0) * sc, _f16(b, 2) * mn)


@_register(_QT.Q6_K)
def dequantize_q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    """Q6_K: 16 sub-blocks of 16, 6-bit codes offset by 32, signed 8-bit scales; ``y = d*sc*q``."""
    n = b.shape[0]
    low = _fields(b[:, :128].reshape(n, 2, 64), 4).view(n, 256)
    high = _fields(b[:, 128:192].reshape(n, 2, 32), 2).view(n, 256)
    q = low.bitwise_or_(high.bitwise_left_shift_(4)).view(torch.int8).sub_(32)
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    _scale(out, q.view(n, 16, 16), _f16(b, 208) * scales)


@_register(_QT.Q8_K)
def dequantize_q8_k(b: torch.Tensor, out: torch.Tensor) -> None:
    """Q8_K: a float32 scale and 256 int8 codes (the 16 int16 block sums are not needed); ``y = d*q``."""
    d = b[:, :4].contiguous().view(torch.float32)
    q = b[:, 4:260].view(torch.int8)
    _scale(out, q.unsqueeze(1), d)


@_register(_QT.Q5_0)
def dequantize_q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    """Q5_0: 32 values, 4 low bits in nibbles plus a 32-bit high-bit word, offset by 16; ``y = d*q``."""
    n = b.shape[0]
    high = _bits(b[:, 2:6])
    q = _fields(b[:, 6:22], 4).view(n, 32)
    q = q.bitwise_or_(high.bitwise_left_shift_(4)).view(torch.int8).sub_(16)
    _scale(out, q.unsqueeze(1), _f16(b, 0))


@_register(_QT.Q5_1)
def dequantize_q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    """Q5_1: Q5_0's codes without the offset, plus an fp16 minimum; ``y = d*q + m``."""
    n = b.shape[0]
    high = _bits(b[:, 4:8])
    q = _fields(b[:, 8:24], 4).view(n, 32)
    q.bitwise_or_(high.bitwise_left_shift_(4))
    out.copy_(q).mul_(_f16(b, 0)).add_(_f16(b, 2))


def _iq4(codes: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    # code book look-up straight into ``out`` (int32 indices: half the memory of int64 ones)
    flat = out.view(-1)
    torch.index_select(_IQ4_VALUES, 0, codes.reshape(-1).int(), out=flat)
    return flat.view(codes.shape)


@_register(_QT.IQ4_NL)
def dequantize_iq4_nl(b: torch.Tensor, out: torch.Tensor) -> None:
    """IQ4_NL: 32 values, 4-bit indices into a fixed non-linear code book; ``y = d*kvalues[q]``."""
    n = b.shape[0]
    _iq4(_fields(b[:, 2:18], 4).view(n, 32), out).mul_(_f16(b, 0))


@_register(_QT.IQ4_XS)
def dequantize_iq4_xs(b: torch.Tensor, out: torch.Tensor) -> None:
    """IQ4_XS: 8 sub-blocks of 32 IQ4_NL codes with signed 6-bit scales; ``y = d*(ls-32)*kvalues[q]``."""
    n = b.shape[0]
    # sub-block i: low 4 bits in nibble i%2 of byte i/2, high 2 bits at bit 2i of the 16-bit word
    sc_low = _fields(b[:, 4:8], 4, dim=-1).view(n, 8)
    sc_high = _fields(b[:, 2:4], 2, dim=-1).view(n, 8)
    scales = sc_low.bitwise_or_(sc_high.bitwise_left_shift_(4)).float().sub_(32)
    dl = _f16(b, 0) * scales
    _iq4(_fields(b[:, 8:136].reshape(n, 8, 16), 4).view(n, 8, 32), out).mul_(dl.unsqueeze(-1))
