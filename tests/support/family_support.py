"""Tiny random checkpoints of a transformers architecture, saved as an HF folder or written as a GGUF
file, and the check that our paged forward matches transformers on them."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from agent_infer.model.loader import LoadedModel, default_model_path
from agent_infer.model.loading.gguf import gguf_name
from agent_infer.model.loading.gguf_reader import GGUFFile
from agent_infer.model.registry import gguf_architecture
from agent_infer.model.runner import SequenceRunner
from agent_infer.model.tokenizer import Tokenizer

#: The SmolLM2 tokenizer is copied into every checkpoint, so the models cover its ids.
VOCAB = 49152


def write_tokenizer_files(directory: Path) -> None:
    """The default model's tokenizer as HF files (``tokenizer.json`` + config with its chat template)."""
    tok = Tokenizer.from_gguf_metadata(GGUFFile(default_model_path()).metadata)
    tok.hf_tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|endoftext|>", "chat_template": tok.chat_template})
    )


def randomize(model: torch.nn.Module, seed: int, std: float = 0.15) -> torch.nn.Module:
    """Spread ``model``'s weights (norm weights around 1) so logits have clear maxima; eval mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen) * std
            p.copy_(1 + noise if "norm" in name else noise)
    return model.eval()


def save_hf(model: Any, directory: Path) -> Path:
    """``model`` saved as safetensors with the default tokenizer: a folder :func:`load_model` reads."""
    model.save_pretrained(directory)
    write_tokenizer_files(directory)
    return directory


def _quantizable(name: str, arr: np.ndarray, qtype: gguf.GGMLQuantizationType | None) -> bool:
    block = gguf.GGML_QUANT_SIZES[qtype][0] if qtype is not None else 0
    return qtype is not None and arr.ndim == 2 and "norm" not in name and arr.shape[1] % block == 0


def round_through(model: Any, qtype: gguf.GGMLQuantizationType) -> Any:
    """Replace every 2-D weight of ``model`` that :func:`write_gguf` quantizes by its value after a
    round trip through ``qtype`` (the ``gguf`` package's reference code): transformers then runs
    exactly the weights the GGUF file holds."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            arr = p.detach().float().numpy()
            if _quantizable(name, arr, qtype):
                back = gguf.quants.dequantize(gguf.quants.quantize(arr, qtype), qtype)
                p.copy_(torch.from_numpy(np.ascontiguousarray(back, dtype=np.float32)).reshape(p.shape))
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter reorders Llama q/k rows for its interleaved RoPE
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    path: Path,
    model: Any,
    arch: str,
    *,
    metadata: Callable[[gguf.GGUFWriter], None] = lambda w: None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    quant: gguf.GGMLQuantizationType | None = None,
) -> Path:
    """``model``'s weights as a GGUF of llama.cpp architecture ``arch``, with its hyper-parameters,
    the default tokenizer and whatever ``metadata`` adds; 2-D weights whose rows fit ``quant``'s
    blocks are stored in that type, everything else in float32."""
    c = model.config
    entry = gguf_architecture(arch)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    meta = GGUFFile(default_model_path()).metadata
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types([int(t) for t in meta["tokenizer.ggml.token_type"]])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    w.add_chat_template(meta["tokenizer.chat_template"])
    metadata(w)
    for hf, tensor in model.state_dict().items():
        if hf == "lm_head.weight" and c.tie_word_embeddings:
            continue
        arr = tensor.detach().float().numpy().copy()
        if hf.endswith("mlp.experts.gate_up_proj"):  # transformers' fused experts [E, 2I, H]
            blk = "blk." + hf.split(".")[2]
            gate, up = np.split(arr, 2, axis=1)
            w.add_tensor(f"{blk}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
            w.add_tensor(f"{blk}.ffn_up_exps.weight", np.ascontiguousarray(up))
            continue
        if hf.endswith("mlp.experts.down_proj"):
            w.add_tensor("blk." + hf.split(".")[2] + ".ffn_down_exps.weight", arr)
            continue
        if entry.gguf_permutes_qk and hf.endswith(("q_proj.weight", "k_proj.weight")):
            arr = _permute(arr, c.num_attention_heads if "q_proj" in hf else c.num_key_value_heads)
        if _quantizable(hf, arr, quant):
            assert quant is not None
            w.add_tensor(gguf_name(entry, hf), gguf.quants.quantize(arr, quant), raw_dtype=quant)
        else:
            w.add_tensor(gguf_name(entry, hf), arr)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def compare_with_transformers(
    lm: LoadedModel, hf: Any, prompt: list[int], *, steps: int = 16, block_size: int = 4
) -> float:
    """Prefill ``prompt`` and greedy-decode ``steps`` tokens through our paged cache; transformers
    runs the whole sequence once. Asserts every greedy pick is transformers' argmax at that position
    (so greedy decoding is identical) and returns max |ours - transformers| / max(1, max |logit|)
    over the prefill's last row and every decode step."""
    runner = SequenceRunner(
        lm.model, num_blocks=-(-(len(prompt) + steps) // block_size) + 2, block_size=block_size
    )
    rows = [runner.step([(0, prompt)])[0]]
    picks: list[int] = []
    for _ in range(steps):
        picks.append(int(rows[-1].argmax()))
        rows.append(runner.step([(0, [picks[-1]])])[0])
    ours = torch.stack(rows)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + picks])).logits[0, len(prompt) - 1 :].float()
    assert ref.argmax(-1)[:steps].tolist() == picks
    return (ours - ref).abs().max().item() / max(1.0, ref.abs().max().item())
