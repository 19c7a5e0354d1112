"""The architecture registry: checkpoint names to families, one table for HF and GGUF names."""

from __future__ import annotations

import re

import pytest

from agent_infer.errors import ModelLoadError
from agent_infer.model.families.gemma3 import Gemma3ForCausalLM
from agent_infer.model.families.llama import LlamaForCausalLM
from agent_infer.model.families.qwen3 import Qwen3ForCausalLM
from agent_infer.model.registry import ARCHITECTURES, architecture, gguf_architecture, hf_architecture


@pytest.mark.parametrize(
    ("hf", "gguf", "family", "permutes", "bias"),
    [
        ("LlamaForCausalLM", "llama", LlamaForCausalLM, True, False),
        ("MistralForCausalLM", "llama", LlamaForCausalLM, True, False),
        ("Qwen2ForCausalLM", "qwen2", LlamaForCausalLM, False, True),
        ("Qwen3ForCausalLM", "qwen3", Qwen3ForCausalLM, False, False),
        ("Gemma3ForCausalLM", "gemma3", Gemma3ForCausalLM, False, False),
    ],
)
def test_hf_and_gguf_names_resolve_to_one_architecture(
    hf: str, gguf: str, family: type, permutes: bool, bias: bool
) -> None:
    found = hf_architecture(hf)
    assert found is gguf_architecture(gguf) is architecture(gguf) is hf_architecture(gguf)
    assert found.name == gguf and found.family is family
    assert (found.gguf_permutes_qk, found.qkv_bias) == (permutes, bias)


def test_unknown_architectures_name_themselves_and_the_supported_ones() -> None:
    gguf_names = ", ".join(a.name for a in ARCHITECTURES if a.gguf_layer_names)
    assert gguf_names.startswith("llama, qwen2, qwen3")
    with pytest.raises(
        ModelLoadError,
        match=rf"^x\.gguf: unsupported architecture 'mamba'; supported: {re.escape(gguf_names)}$",
    ):
        gguf_architecture("mamba", "x.gguf: ")
    hf_names = ", ".join(n for a in ARCHITECTURES for n in a.hf_names)
    assert hf_names.startswith("LlamaForCausalLM, llama, MistralForCausalLM, mistral, Qwen2ForCausalLM")
    with pytest.raises(
        ModelLoadError,
        match=rf"unsupported architecture 'MambaForCausalLM'; supported: {re.escape(hf_names)}$",
    ):
        hf_architecture("MambaForCausalLM")


def test_every_gguf_name_maps_to_a_distinct_hf_name() -> None:
    for arch in ARCHITECTURES:
        hf_names = [*arch.gguf_global_names.values(), *arch.gguf_layer_names.values()]
        assert len(hf_names) == len(set(hf_names)), arch.name
