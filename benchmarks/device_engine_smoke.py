"""Engine smoke test for ``device_check.sh``: a tiny random-weight Llama, JSON-Schema constrained, CPU vs GPU.

The default GGUF cannot travel to the GPU machine (98 MB), so this builds a 2-layer random Llama
as a Hugging Face folder (``config.json`` + ``model.safetensors``, weights drawn from a fixed seed
on the CPU, so every machine gets the same bits) next to the SmolLM2 tokenizer, exported here with
``--prepare DIR`` (from the GGUF, through our own tokenizer reader) and carried over.

    python benchmarks/device_engine_smoke.py --prepare build/device_check        # here, once
    python3 benchmarks/device_engine_smoke.py --tokenizer build/device_check --out $OUT/engine_smoke.json

Runs (8 prompts in one ``generate`` call, greedy): CPU float32 (the reference); NVIDIA float32
with each mask backend forced (auto, triton, cuda, torch); NVIDIA bfloat16; NVIDIA with async
scheduling off and with forced tokens off (when the engine has those options); plus one
unconstrained greedy run per device. Checks: every constrained output parses and validates
(jsonschema when installed) with finish reason ``stop``; the GPU runs with different mask backends
give identical tokens (masking is exact, so they must); CPU vs GPU token agreement is reported
(float32 reductions differ in order, so near-ties may flip). Exit status 1 when a check fails.
``--devices cpu`` runs the CPU part only (the dry run on a machine without a GPU).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "species": {"enum": ["cat", "dog", "bird", "fish"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 40},
        "vaccinated": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["calm", "loud", "old", "young"]}, "maxItems": 3},
    },
    "required": ["name", "species", "age", "vaccinated", "tags"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a pet as JSON.",
    "Give me a JSON record for a dog.",
    "A cat named Tom, age 3. JSON please.",
    "Return one pet object.",
    "Invent a bird and describe it in JSON.",
    "JSON for a fish that is 2 years old.",
    "Describe an old dog.",
    "Make up a pet.",
]
MODEL_DIMS = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2}


def prepare(dest: Path) -> None:
    """Export the SmolLM2 tokenizer (tokenizer.json + tokenizer_config.json) from the default GGUF."""
    from agent_infer.model.loader import default_model_path
    from agent_infer.model.loading.gguf_reader import GGUFFile
    from agent_infer.model.tokenizer import Tokenizer

    dest.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_gguf_metadata(GGUFFile(default_model_path()).metadata)
    tok.hf_tokenizer.save(str(dest / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "chat_template": tok.chat_template}
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    print(
        f"wrote {dest}/tokenizer.json ({tok.hf_tokenizer.get_vocab_size()} tokens) and tokenizer_config.json"
    )


def build_model(dest: Path, tokenizer_dir: Path, seed: int = 0) -> None:
    """Write a random Llama (seeded, drawn on the CPU) as a Hugging Face folder into ``dest``."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer as HFTokenizer

    vocab = HFTokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    h, inter, layers = MODEL_DIMS["hidden"], MODEL_DIMS["intermediate"], MODEL_DIMS["layers"]
    heads, kv_heads = MODEL_DIMS["heads"], MODEL_DIMS["kv_heads"]
    head_dim = h // heads
    g = torch.Generator().manual_seed(seed)

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        # 1/sqrt(fan_in) keeps activations O(1), so logits are spread out and argmax ties are rare.
        return torch.randn((out_f, in_f), generator=g) / in_f**0.5

    weights = {"model.embed_tokens.weight": torch.randn((vocab, h), generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": linear(heads * head_dim, h),
            p + "self_attn.k_proj.weight": linear(kv_heads * head_dim, h),
            p + "self_attn.v_proj.weight": linear(kv_heads * head_dim, h),
            p + "self_attn.o_proj.weight": linear(h, heads * head_dim),
            p + "mlp.gate_proj.weight": linear(inter, h),
            p + "mlp.up_proj.weight": linear(inter, h),
            p + "mlp.down_proj.weight": linear(h, inter),
        }
    weights["model.norm.weight"] = torch.ones(h)
    weights["lm_head.weight"] = linear(vocab, h) * 4.0
    dest.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(dest / "model.safetensors"))
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
        "hidden_size": h, "intermediate_size": inter, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": 1024,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
    }  # fmt: skip
    (dest / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, dest / name)


def validator() -> Any:
    """A function text -> error string or None (jsonschema when installed, else JSON parse only)."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None

    def check(text: str) -> str | None:
        try:
            value = json.loads(text)
        except ValueError as exc:
            return f"not JSON: {exc}"
        if jsonschema is not None:
            try:
                jsonschema.validate(value, SCHEMA)
            except jsonschema.ValidationError as exc:
                return f"schema: {exc.message}"
        return None

    return check


def run_case(
    model_dir: Path, label: str, accelerator: str, dtype: str, backend: str, **options: Any
) -> dict[str, Any]:
    """One LLM with these settings: constrained batch of 8 and unconstrained batch of 8, greedy."""
    from agent_infer import LLM, SamplingParams
    from agent_infer.engine.config import EngineConfig
    from agent_infer.grammar.runtime.bitmask import select_backend

    known = {f.name for f in dataclasses.fields(EngineConfig)}
    skipped = [k for k in options if k not in known]
    if skipped:
        return {
            "label": label,
            "skipped": f"EngineConfig has no {', '.join(skipped)} (engine not updated yet)",
        }
    os.environ["AGENT_INFER_MASK_BACKEND"] = backend
    record: dict[str, Any] = {"label": label, "accelerator": accelerator, "dtype": dtype, "backend": backend}
    try:
        start = time.perf_counter()
        llm = LLM(
            str(model_dir), accelerator=accelerator, dtype=dtype, kv_cache_memory_bytes=64 << 20, **options
        )
        record["load_s"] = round(time.perf_counter() - start, 3)
        probe = torch.empty(
            1, 64, dtype=getattr(torch, dtype), device="cuda" if accelerator == "nvidia" else "cpu"
        )
        record["mask_backend"] = select_backend(probe)
        check = validator()
        params = SamplingParams(temperature=0.0, max_tokens=160, structured=SCHEMA)
        start = time.perf_counter()
        outs = llm.generate(PROMPTS, params)
        record["constrained_s"] = round(time.perf_counter() - start, 3)
        record["tokens"] = [o.outputs[0].token_ids for o in outs]
        record["texts"] = [o.outputs[0].text for o in outs]
        record["finish"] = [o.outputs[0].finish_reason for o in outs]
        record["errors"] = [check(o.outputs[0].text) for o in outs]
        record["valid"] = sum(e is None for e in record["errors"])
        free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        record["free_tokens"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free)]
    except Exception as exc:  # one broken configuration is reported, the others still run
        record["exception"] = f"{type(exc).__name__}: {exc}"
    finally:
        os.environ.pop("AGENT_INFER_MASK_BACKEND", None)
    return record


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How many sequences are identical, and the shortest common prefix."""
    same = sum(x == y for x, y in zip(a, b))
    prefixes = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return {"identical": same, "of": len(a), "common_prefix_min": min(prefixes) if prefixes else 0}


def main(argv: list[str] | None = None) -> int:
    """Prepare the tokenizer folder, or run the smoke test and write the JSON report."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prepare", type=Path, help="export the tokenizer files into this folder and exit")
    parser.add_argument("--tokenizer", type=Path, default=Path("build/device_check"))
    parser.add_argument("--devices", default="cpu,nvidia")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.prepare:
        prepare(args.prepare)
        return 0
    devices = args.devices.split(",")
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "tiny-llama"
        build_model(model_dir, args.tokenizer)
        if "cpu" in devices:
            runs.append(run_case(model_dir, "cpu fp32", "cpu", "float32", "auto"))
            runs.append(run_case(model_dir, "cpu fp32 torch-mask", "cpu", "float32", "torch"))
        if "nvidia" in devices:
            for backend in ("auto", "triton", "cuda", "torch"):
                runs.append(run_case(model_dir, f"nvidia fp32 {backend}", "nvidia", "float32", backend))
            runs.append(run_case(model_dir, "nvidia bf16 auto", "nvidia", "bfloat16", "auto"))
            runs.append(
                run_case(model_dir, "nvidia fp32 sync", "nvidia", "float32", "auto", async_scheduling=False)
            )
            runs.append(
                run_case(model_dir, "nvidia fp32 no-forced", "nvidia", "float32", "auto", forced_tokens=False)
            )
    failures: list[str] = []
    for r in runs:
        if "skipped" in r:
            continue
        if "exception" in r:
            failures.append(f"{r['label']}: {r['exception']}")
        elif r["valid"] != len(PROMPTS) or any(f != "stop" for f in r["finish"]):
            failures.append(f"{r['label']}: {r['valid']}/{len(PROMPTS)} valid, finish {r['finish']}")
    by_label = {r["label"]: r for r in runs if "tokens" in r}
    comparisons: dict[str, Any] = {}
    for ref_label, group in (
        ("cpu fp32", ["cpu fp32 torch-mask"]),
        (
            "nvidia fp32 torch",
            ["nvidia fp32 auto", "nvidia fp32 triton", "nvidia fp32 cuda", "nvidia fp32 sync"],
        ),
    ):
        ref = by_label.get(ref_label)
        for label in group:
            other = by_label.get(label)
            if ref and other:
                comparisons[f"{label} vs {ref_label}"] = agreement(other["tokens"], ref["tokens"])
                if other["tokens"] != ref["tokens"]:
                    failures.append(
                        f"{label}: tokens differ from {ref_label} (mask backends must agree exactly)"
                    )
    cpu, gpu = by_label.get("cpu fp32"), by_label.get("nvidia fp32 auto")
    if cpu and gpu:
        comparisons["nvidia vs cpu (constrained, reported)"] = agreement(gpu["tokens"], cpu["tokens"])
        comparisons["nvidia vs cpu (unconstrained, reported)"] = agreement(
            gpu["free_tokens"], cpu["free_tokens"]
        )
    report = {
        "schema": SCHEMA,
        "model": MODEL_DIMS,
        "runs": runs,
        "comparisons": comparisons,
        "failures": failures,
    }
    for r in runs:
        summary = {
            k: r.get(k) for k in ("label", "mask_backend", "valid", "constrained_s", "skipped", "exception")
        }
        print(json.dumps({k: v for k, v in summary.items() if v is not None}))
    print(json.dumps(comparisons, indent=1))
    print("FAILURES:\n  " + "\n  ".join(failures) if failures else "engine smoke: all checks passed")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
