"""A tiny random DeepSeek V3 checkpoint with a skewed router, shared by the parallel tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from deepseek_support import save_tiny, write_tokenizer


@pytest.fixture(autouse=True, scope="session")
def _torch_kernels() -> Iterator[None]:
    """Expert-parallel ranks and context-parallel prefill run the torch kernels (the packed float
    kernel is not split over ranks), so the one-process references here run them too: the tests
    compare bits, and the two kernels round differently."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENT_INFER_NATIVE_LINEAR", "0")
        yield


def _checkpoint(directory: Path) -> Path:
    """The tiny V3 (512 positions) with experts 0 and 1 made hot (their correction bias raised), so most tokens go there."""
    hf = save_tiny(directory, vocab_size=49152, max_position_embeddings=512)  # room for tool prompts
    with torch.no_grad():
        for layer in hf.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias[:2] += 2.0
    hf.save_pretrained(directory)
    write_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(_checkpoint(tmp_path_factory.mktemp("tiny_v3")))


CHECKPOINTS = Path(__file__).resolve().parents[2] / "checkpoints"


@pytest.fixture(scope="session")
def trained_v3() -> str:
    """The trained tiny DeepSeek V3 (block FP8, an MTP layer, 129k vocabulary)."""
    return str(CHECKPOINTS / "tiny-deepseek-v3")


@pytest.fixture(scope="session")
def trained_v4() -> str:
    """The trained tiny DeepSeek V4 (a hash-routed layer, swiglu_limit, block FP8)."""
    return str(CHECKPOINTS / "tiny-deepseek-v4")
