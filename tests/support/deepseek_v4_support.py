"""Tiny random DeepSeek V4 checkpoints saved with transformers (the oracle), and a direct loader for them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

#: Every attention kind and both routings: heavy, sparse, sliding-only, sparse, heavy; two hash layers.
LAYER_TYPES = [
    "heavily_compressed_attention",
    "compressed_sparse_attention",
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
]
MLP_TYPES = ["hash_moe", "hash_moe", "moe", "moe", "moe"]
COMPRESS_YARN = {
    "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
}  # fmt: skip


def tiny_config(*, yarn: bool = False, **overrides: Any) -> Any:
    """A 5-layer DeepseekV4Config of 8 experts: CSA (rate 4, top-3 indexer) and HCA (rate 8) layers,
    a sliding-only layer, an 8-token window, and a low ``swiglu_limit`` that clamps."""
    import transformers

    kw: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
        head_dim=32, partial_rotary_factor=0.25, q_lora_rank=48, num_experts_per_tok=2, n_routed_experts=8,
        layer_types=list(LAYER_TYPES), mlp_layer_types=list(MLP_TYPES),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        sliding_window=8, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3,
        hc_mult=4, hc_sinkhorn_iters=20, swiglu_limit=1.5, routed_scaling_factor=1.5,
        num_nextn_predict_layers=0, max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=0, bos_token_id=1,
    )  # fmt: skip
    if yarn:
        kw["rope_parameters"] = dict(COMPRESS_YARN)
    kw.update(overrides)
    return transformers.DeepseekV4Config(**kw)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Unit-scale activations (transformers' 0.02 init makes every logit nearly equal), norms and
    mixing scales near one, a correction bias that changes the chosen experts, and a hash table
    routing each token to distinct experts."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "inv_freq" in name:
                continue
            if name.endswith("tid2eid"):
                experts = int(model.config.n_routed_experts)
                order = torch.rand(p.shape[0], experts, generator=gen).argsort(dim=-1)
                p.copy_(order[:, : p.shape[1]])
                continue
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.2 * noise)
            elif p.dim() == 1:
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def save_tiny(directory: Path, seed: int = 0, **config: Any) -> Any:
    """Save a randomized tiny V4 model to ``directory``; returns the transformers model (eval, float32)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(tiny_config(**config)).eval()
    randomize(model, seed)
    model.save_pretrained(directory)
    return model


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _pow2_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """The power of two (a ue8m0 value) that brings ``amax`` to at most ``top``."""
    return torch.exp2(torch.ceil(torch.log2(amax.clamp(min=1e-30) / top)))


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


def quantize_fp8(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 with power-of-two (ue8m0) scales, as DeepSeek's V4 release stores its projections."""
    rows, cols = w.shape
    br, bc = block
    scale = torch.empty(-(-rows // br), -(-cols // bc))
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            scale[i, j] = _pow2_scale(w[i * br : (i + 1) * br, j * bc : (j + 1) * bc].abs().max(), 448.0)
    spread = scale.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return (w / spread).to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


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
            q, s = quantize_fp8(w, block)
            shards[1][out], shards[0][module + "scale"] = q, s
            spread = s.float().repeat_interleave(block[0], 0)[: w.shape[0]].repeat_interleave(block[1], 1)
            dequantized[name] = q.float() * spread[:, : w.shape[1]]
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
