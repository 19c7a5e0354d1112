"""KV blocks behind a sliding window are released when every layer slides (Mistral): a long
generation holds a bounded number of blocks and gives exactly the logits of a run that keeps them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from engine_support import drain
from family_support import randomize, save_hf, write_gguf

from agent_infer.engine.block_manager import BlockManager, window_of_every_layer
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.engine.sequence import Sequence
from agent_infer.model.loader import load_model
from agent_infer.sampling_params import SamplingParams

WINDOW = 8
BLOCK = 4


def test_window_of_every_layer() -> None:
    assert window_of_every_layer(None, ()) is None
    assert window_of_every_layer(4096, ()) == 4096  # Mistral: the window applies to every layer
    assert window_of_every_layer(512, ("sliding_attention",) * 3) == 512
    # Gemma 3: global layers read every position, so no block is ever behind all windows
    assert window_of_every_layer(512, ("sliding_attention", "full_attention")) is None


def _grow(bm: BlockManager, seq: Sequence, steps: int) -> int:
    """Decode ``steps`` tokens as the scheduler would; the most blocks ``seq`` held at once."""
    most = 0
    for _ in range(steps):
        seq.num_computed_tokens = seq.num_tokens
        bm.register_computed(seq)
        bm.release_behind_window(seq)
        seq.append_token(7)
        bm.append(seq)
        most = max(most, bm.num_held_blocks(seq))
    return most


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_held_blocks_stay_bounded_and_all_return(prefix_caching: bool) -> None:
    bm = BlockManager(64, BLOCK, prefix_caching, sliding_window=WINDOW)
    seq = Sequence("a", list(range(10)), SamplingParams(max_tokens=500))
    bm.allocate(seq)
    most = _grow(bm, seq, 300)
    # the window's blocks, the one being written, and (prefix caching) the last published block
    assert most <= WINDOW // BLOCK + 2 + int(prefix_caching)
    assert len(seq.block_table) == bm.blocks_needed(seq.num_tokens)  # ids stay aligned with positions
    assert bm.num_free_blocks == 64 - bm.num_held_blocks(seq)
    bm.deallocate(seq)
    assert bm.num_free_blocks == 64 and seq.num_released_blocks == 0
    assert all(b.ref_count == 0 for b in bm.blocks)


def test_released_blocks_keep_their_prefix_for_new_requests() -> None:
    bm = BlockManager(64, BLOCK, True, sliding_window=WINDOW)
    prompt = list(range(100, 140))
    a = Sequence("a", prompt, SamplingParams(max_tokens=50))
    bm.allocate(a)
    _grow(bm, a, 3)
    assert a.num_released_blocks > 0
    # a new request with the same prompt revives the released blocks from the prefix cache
    b = Sequence("b", [*prompt, 1], SamplingParams(max_tokens=5))
    bm.allocate(b)
    assert b.num_computed_tokens == len(prompt)
    assert b.block_table[: len(prompt) // BLOCK] == a.block_table[: len(prompt) // BLOCK]
    bm.deallocate(a)
    bm.deallocate(b)
    assert bm.num_free_blocks == 64 and all(blk.ref_count == 0 for blk in bm.blocks)


def test_no_window_releases_nothing() -> None:
    bm = BlockManager(64, BLOCK, False)
    seq = Sequence("a", list(range(10)), SamplingParams(max_tokens=100))
    bm.allocate(seq)
    _grow(bm, seq, 60)
    assert seq.num_released_blocks == 0 and bm.num_held_blocks(seq) == bm.blocks_needed(seq.num_tokens)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Mistral as an HF folder (torch path) and as a Q8_0 GGUF (native kernels)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
        sliding_window=WINDOW, rope_theta=1e4, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = randomize(transformers.MistralForCausalLM(config), seed=3)
    folder = save_hf(model, tmp_path_factory.mktemp("mistral"))
    path = write_gguf(
        folder.parent / "mistral.gguf", model, "llama", metadata=lambda w: w.add_sliding_window(WINDOW),
        quant=gguf.GGMLQuantizationType.Q8_0,
    )  # fmt: skip
    return {"hf": folder, "gguf-native": path}


def _generate(loaded: Any, release: bool, prefix_caching: bool) -> tuple[list[Any], int]:
    # the pool holds all three sequences unreleased: no preemption, so both runs schedule alike
    engine = LLMEngine(
        config=EngineConfig(block_size=BLOCK, num_kv_blocks=160, enable_prefix_caching=prefix_caching),
        loaded=loaded,
    )
    if not release:
        engine.block_manager.sliding_window = None
    params = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True, logprobs=3)
    prompts = [[1, 300, 301, 302, 303, 304, 305], [1, 500, 501], [1, 300, 301, 302, 303, 304, 305, 9]]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    most = 0
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        most = max(most, engine.block_manager.num_blocks - engine.block_manager.num_free_blocks)
    done.update(drain(engine))
    return [done[f"r{i}"].outputs[0] for i in range(len(prompts))], most


@pytest.mark.parametrize(("kind", "prefix_caching"), [("hf", False), ("hf", True), ("gguf-native", True)])
def test_long_generation_is_bounded_and_identical(
    mistral: dict[str, Path], kind: str, prefix_caching: bool
) -> None:
    loaded = load_model(str(mistral[kind]), device=torch.device("cpu"))
    assert loaded.model.native == (kind == "gguf-native")
    kept, most_kept = _generate(loaded, release=False, prefix_caching=prefix_caching)
    freed, most_freed = _generate(loaded, release=True, prefix_caching=prefix_caching)
    for a, b in zip(kept, freed, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs  # every step's top logprobs, bit for bit
    # 3 sequences of ~170 tokens keep ~43 blocks each; released, each holds its window's blocks
    # plus the ones being written (and drafts), whatever its length
    assert most_kept >= 3 * 160 // BLOCK
    assert most_freed <= 3 * (WINDOW // BLOCK + 5), most_freed
