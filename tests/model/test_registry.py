"""The architecture registry: checkpoint names to families, one table for HF and GGUF names."""

from __future__ import annotations

import pytest

from agent_infer.errors import ModelLoadError
from agent_infer.model.families.gemma3 import Gemma3ForCausalLM
from agent_infer.model.families.llama import LlamaForCausalLM
from agent_infer.model.registry import ARCHITECTURES, architecture, gguf_architecture, hf_architecture


@pytest.mark.parametrize(
    ("hf", "gguf", "family", "permutes", "bias"),
    [
        ("LlamaForCausalLM", "llama", LlamaForCausalLM, True, False),
        ("Qwen2ForCausalLM", "qwen2", LlamaForCausalLM, False, True),
        ("Gemma3ForCausalLM", "gemma3", Gemma3ForCausalLM, False, False),
    ],
)
def test_hf_and_gguf_names_resolve_to_one_architecture(
    hf: str, gguf: str, family: type, permutes: bool, bias: bool
) -> None:
    found = hf_architecture(hf)
    assert found is gguf_architecture(gguf) is architecture(gguf)
    assert found.name == gguf and found.family is family
    assert (found.gguf_permutes_qk, found.qkv_bias) == (permutes, bias)


def test_unknown_architectures_name_themselves_and_the_supported_ones() -> None:
    with pytest.raises(
        ModelLoadError, match=r"^x\.gguf: unsupported architecture 'mamba'; supported: llama, qwen2(, \w+)*$"
    ) as err:
        gguf_architecture("mamba", "x.gguf: ")
    assert ", gemma3" in str(err.value)
    with pytest.raises(
        ModelLoadError,
        match=r"unsupported architecture 'MambaForCausalLM'; supported: LlamaForCausalLM, llama, Qwen2ForCausalLM, qwen2",
    ) as err:
        hf_architecture("MambaForCausalLM")
    assert "Gemma3ForCausalLM, gemma3_text" in str(err.value)


def test_every_gguf_name_maps_to_a_distinct_hf_name() -> None:
    for arch in ARCHITECTURES:
        hf_names = [*arch.gguf_global_names.values(), *arch.gguf_layer_names.values()]
        assert len(hf_names) == len(set(hf_names)), arch.name
