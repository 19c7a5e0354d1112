"""Writing a trained model as a DeepSeek checkpoint folder: ``save_pretrained`` names, the MTP layer as
``model.layers.{num_hidden_layers}.*``, and DeepSeek's block FP8 layout for the large matrices.

FP8 (``float8_e4m3fn`` values, one float32 ``<name>_scale_inv`` per 128x128 block, the amax of the
block over 448) holds every 2-D weight of 4,096 values or more except the MoE routers, which DeepSeek
keeps in full precision; the rest is bfloat16. That includes the embedding, which DeepSeek itself
keeps in bfloat16: at 129,280 x 64 it is what the size budget is spent on.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8_BLOCK = (128, 128)
FP8_MAX = 448.0
_MIN_FP8_NUMEL = 4096


def saved_tensors(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The tensors ``model.save_pretrained`` writes, by their checkpoint names (float32), and its
    ``config.json``."""
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        config = json.loads((Path(tmp) / "config.json").read_text(encoding="utf-8"))
        out: dict[str, torch.Tensor] = {}
        for path in sorted(Path(tmp).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    t = f.get_tensor(name)
                    out[name] = (t.float() if t.is_floating_point() else t).clone()
        return out, config


def quantize_block_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8, scale_inv)`` with ``fp8 * scale_inv`` per block approximating ``weight``."""
    rows, cols = weight.shape
    br, bc = FP8_BLOCK
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(nr, br, nc, bc)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nr * br, nc * bc)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.float().contiguous()


def dequantize_block_fp8(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The float32 weight ``q * scale_inv`` (each scale spread over its block)."""
    rows, cols = q.shape
    br, bc = FP8_BLOCK
    scale = scale_inv.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return q.float() * scale


def fp8_eligible(name: str, tensor: torch.Tensor) -> bool:
    """Whether ``name`` is stored in FP8: a large 2-D weight that is not a router."""
    return tensor.dim() == 2 and tensor.numel() >= _MIN_FP8_NUMEL and not name.endswith("mlp.gate.weight")


def to_checkpoint(
    tensors: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(stored, effective)``: the tensors to write (FP8 + scales, the rest bfloat16 or, for integer
    buffers, as they are) and the float32 weights they stand for, which the model is evaluated with."""
    stored: dict[str, torch.Tensor] = {}
    effective: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if not t.is_floating_point():
            stored[name] = effective[name] = t
        elif fp8_eligible(name, t):
            q, s = quantize_block_fp8(t)
            stored[name], stored[name + "_scale_inv"] = q, s
            effective[name] = dequantize_block_fp8(q, s)
        elif name.endswith(("e_score_correction_bias", "mlp.gate.weight")):
            stored[name] = effective[name] = t.float().contiguous()
        else:
            stored[name] = t.to(torch.bfloat16).contiguous()
            effective[name] = stored[name].float()
    return stored, effective


def write_folder(
    out: Path, stored: dict[str, torch.Tensor], config: dict[str, Any], tokenizer_config: dict[str, Any]
) -> None:
    """Write ``model.safetensors``, ``config.json`` (with the FP8 ``quantization_config``) and
    ``tokenizer_config.json`` to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    config["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK),
    }  # fmt: skip
    save_file(dict(sorted(stored.items())), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n"
    )
