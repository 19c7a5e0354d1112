"""DeepSeek V4 decode speed and cache size: ``bench_engine.py`` on a V4 folder, by default the tests'
tiny random one.

Without ``--model`` it writes the tiny random 5-layer V4 checkpoint of the tests (hidden 64, 8
experts, vocabulary 49,152 with the SmolLM2 tokenizer and chat template) to a temporary folder; the
rest is ``bench_engine.py``'s: agent-infer's ``LLMEngine`` against transformers' ``generate`` on the
weights our loader reads, the same chat-formatted prompt ids, greedy decoding with EOS ignored,
engines interleaved in every repeat, medians after a warm-up, and the KV bytes per token against a
GQA model of the same width. Other arguments go to ``bench_engine.py`` unchanged. The compressed
layout's bytes per token depend on the block size (entries are shared by the tokens of a window),
so they are printed for a few block sizes after the table.

    OMP_WAIT_POLICY=PASSIVE .venv/bin/python benchmarks/bench_deepseek.py [--model FOLDER] [--skip bf16]
"""

from __future__ import annotations

import os

# Must be set before torch (and its OpenMP runtime) loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_engine  # noqa: E402 - after the path set-up above

BLOCK_SIZES = (16, 64, 128)


def tiny_v4_folder(directory: Path) -> Path:
    """The tests' tiny random V4 checkpoint with a tokenizer, written to ``directory``."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from deepseek_support import save_tiny_v4, write_tokenizer

    save_tiny_v4(directory, vocab_size=49152)
    write_tokenizer(directory)
    return directory


def compressed_bytes(folder: Path) -> list[str]:
    """Bytes per token of the folder's compressed layout (float32) at each of :data:`BLOCK_SIZES`."""
    from agent_infer.model.kv_cache import KVCache
    from agent_infer.model.loading.hf import hf_config

    config = hf_config(folder)
    return [
        f"compressed layout, block {b}: {KVCache.bytes_per_token(config, b, torch.float32):,.1f} bytes/token"
        for b in BLOCK_SIZES
    ]


def main(argv: list[str] | None = None) -> int:
    """Run ``bench_engine.py`` on the folder; returns its exit status."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, help="DeepseekV4ForCausalLM folder (default: tiny random one)")
    args, rest = parser.parse_known_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model or tiny_v4_folder(Path(tmp))
        status = bench_engine.main(["--model", str(folder), *rest])
        print("\n".join(compressed_bytes(folder)))
    return status


if __name__ == "__main__":
    sys.exit(main())
