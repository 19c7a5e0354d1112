"""DeepSeek's quantized file layouts, written from a float checkpoint for the loader's tests: block FP8
(``<name>_scale_inv``, as DeepSeek's V3 and the Hugging Face V4 checkpoints store it) and the released
V4 layout (DeepSeek's names, FP4 routed experts, FP8 projections with ue8m0 ``.scale`` tensors). Each
writer also writes the checkpoint's dequantized twin: the float32 values the loader must produce,
computed here independently of it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch


def _pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The power of two (a ue8m0 value) that brings ``amax`` to at most ``top``."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / top)))


def quantize_block_fp8(
    w: torch.Tensor, block: tuple[int, int], ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8: per block the scale amax / 448 (float32), or with ``ue8m0`` the power of two above
    it (``float8_e8m0fnu``, as DeepSeek's V4 release stores it), and the weight divided by it in e4m3;
    returns (FP8 weight, scales)."""
    rows, cols = w.shape
    br, bc = block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc)
    padded[:rows, :cols] = w
    blocks = padded.view(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = _pow2_scale(amax, 448.0) if ue8m0 else amax / 448.0
    q = (blocks / scale[:, None, :, None]).view(nr * br, nc * bc)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu) if ue8m0 else scale


def dequantize_block_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``q * scale`` with each scale spread over its block (written out here, not our loader's)."""
    spread = scale.float().repeat_interleave(block[0], 0)[: q.shape[0]].repeat_interleave(block[1], 1)
    return q.float() * spread[:, : q.shape[1]]


def write_fp8(
    src: Path, dst: Path, block: tuple[int, int], quantized: Callable[[str], bool]
) -> tuple[int, Path]:
    """An FP8 copy of ``src`` (the tensors ``quantized`` names, in ``block`` blocks) in two shards,
    scales apart from their weights, and its dequantized twin in ``dst`` + ``-twin``; returns how
    many tensors were quantized and the twin's folder."""
    from safetensors.torch import load_file, save_file

    twin = dst.parent / (dst.name + "-twin")
    dst.mkdir()
    twin.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (twin / "config.json").write_text(json.dumps(cfg))
    cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(cfg))
    weights, scales, dequantized = {}, {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if quantized(name):
            q, s = quantize_block_fp8(w, block)
            weights[name], scales[name + "_scale_inv"] = q, s
            dequantized[name] = dequantize_block_fp8(q, s, block)
        else:
            weights[name] = dequantized[name] = w
    save_file(weights, dst / "a.safetensors")
    save_file(scales, dst / "b.safetensors")
    save_file(dequantized, twin / "model.safetensors")
    index = {n: "a.safetensors" for n in weights} | {n: "b.safetensors" for n in scales}
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    return len(scales), twin


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's FP4 experts: per 32 columns of a row a power-of-two scale (``float8_e8m0fnu``) and
    e2m1 nibbles rounded to nearest, two per byte (even column low); returns (int8 bytes, scales)."""
    rows, cols = w.shape
    groups = -(-cols // 32)
    padded = torch.zeros(rows, groups * 32)
    padded[:, :cols] = w
    g = padded.view(rows, groups, 32)
    scale = _pow2_scale(g.abs().amax(-1), 6.0)
    q = g / scale[..., None]
    code = (q.abs()[..., None] - E2M1).abs().argmin(-1) | (q < 0).long() << 3
    code = code.view(rows, -1)[:, :cols]
    packed = (code[:, 0::2] | code[:, 1::2] << 4).to(torch.uint8).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 values of :func:`quantize_fp4`'s output (written out here, not our loader's)."""
    u8 = packed.view(torch.uint8).long()
    signed = torch.cat((E2M1, -E2M1))
    values = torch.stack((signed[u8 & 15], signed[u8 >> 4]), -1).flatten(1)
    return values * scale.float().repeat_interleave(32, 1)[:, : values.shape[1]]


def released_name(ours: str) -> str:
    """DeepSeek's released name of one of our tensor names (the inverse of the loader's renaming)."""
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
    if ours in top:
        return top[ours]
    if ours.startswith("model.hc_head.hc_"):
        return "hc_head_" + ours.removeprefix("model.hc_head.hc_")
    return ours.removeprefix("model.").replace(".attn.norm.", ".attn.kv_norm.")


#: What the release stores in FP8 (block scales) and in bfloat16; routed experts are FP4, the rest float32.
RELEASED_FP8 = (
    "attn.wq_a.",
    "attn.wq_b.",
    "attn.wkv.",
    "attn.wo_a.",
    "attn.wo_b.",
    "indexer.wq_b.",
    "shared_experts.",
)
RELEASED_BF16 = ("embed.weight", "head.weight", "norm.weight", "gate.weight", "weights_proj.weight")


def save_released(src: Path, dst: Path, block: tuple[int, int] = (128, 128)) -> tuple[Path, int]:
    """Write ``src`` (a folder :func:`save_tiny` wrote) in DeepSeek's released V4 layout to ``dst``: its
    names, FP4 routed experts, FP8 projections with ue8m0 ``.scale`` tensors in ``block`` blocks,
    bfloat16 embedding, head, norms and router, ``int32`` hash tables, two shards with an index. Its
    dequantized twin, in our naming and float32, goes to ``dst`` + ``-twin``; returns the twin's
    folder and how many FP4 tensors were written."""
    from safetensors.torch import load_file, save_file

    twin = dst.parent / (dst.name + "-twin")
    dst.mkdir()
    twin.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (twin / "config.json").write_text(json.dumps(cfg))
    cfg["expert_dtype"] = "fp4"
    cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "scale_fmt": "ue8m0",
        "weight_block_size": list(block),
    }  # fmt: skip
    (dst / "config.json").write_text(json.dumps(cfg))
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    dequantized: dict[str, torch.Tensor] = {}
    fp4 = 0
    for name, w in load_file(src / "model.safetensors").items():
        out = released_name(name)
        module = out.removesuffix("weight")
        if ".experts." in name and ".shared_experts." not in name:
            q, s = quantize_fp4(w)
            shards[0][out], shards[1][module + "scale"] = q, s
            dequantized[name] = dequantize_fp4(q, s)
            fp4 += 1
        elif any(k in name for k in RELEASED_FP8) and name.endswith(".weight"):
            q, s = quantize_block_fp8(w, block, ue8m0=True)
            shards[1][out], shards[0][module + "scale"] = q, s
            dequantized[name] = dequantize_block_fp8(q, s, block)
        elif name.endswith(RELEASED_BF16) and w.is_floating_point():
            shards[0][out] = w.to(torch.bfloat16)
            dequantized[name] = shards[0][out].float()
        elif name.endswith("tid2eid"):
            shards[0][out] = w.to(torch.int32)
            dequantized[name] = w
        else:
            shards[0][out] = dequantized[name] = w
    index = {}
    for i, tensors in enumerate(shards):
        save_file(tensors, dst / f"model-{i + 1:05d}-of-00002.safetensors", metadata={"format": "pt"})
        index.update({n: f"model-{i + 1:05d}-of-00002.safetensors" for n in tensors})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    save_file(dequantized, twin / "model.safetensors")
    return twin, fp4
