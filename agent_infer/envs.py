"""Every ``AGENT_INFER_*`` environment variable, read in this one place.

Values are read at call time (not import time) so tests and users can change them in-process.
"""

from __future__ import annotations

import os
from pathlib import Path

from agent_infer.errors import ConfigError

_ACCELERATORS = ("auto", "cpu", "nvidia", "ascend")


def _get(name: str, default: str) -> str:
    return os.environ.get(name, default).strip()


def _flag(name: str, default: bool) -> bool:
    raw = _get(name, "1" if default else "0").lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")


def _int(name: str, default: int, minimum: int = 0) -> int:
    raw = _get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} must be >= {minimum}")
    return value


def accelerator() -> str:
    """``AGENT_INFER_ACCELERATOR``: auto | cpu | nvidia | ascend (default auto)."""
    value = _get("AGENT_INFER_ACCELERATOR", "auto").lower()
    if value not in _ACCELERATORS:
        raise ConfigError(f"AGENT_INFER_ACCELERATOR={value!r}; expected one of {', '.join(_ACCELERATORS)}")
    return value


def model_dir() -> str | None:
    """``AGENT_INFER_MODEL_DIR``: a model on disk (GGUF file or Hugging Face directory) used by default."""
    value = _get("AGENT_INFER_MODEL_DIR", "")
    return value or None


def cache_dir() -> Path:
    """``AGENT_INFER_CACHE_DIR``: where converted weights are cached (default ~/.cache/agent_infer)."""
    value = _get("AGENT_INFER_CACHE_DIR", "")
    return Path(value) if value else Path.home() / ".cache" / "agent_infer"


def weight_cache_enabled() -> bool:
    """``AGENT_INFER_WEIGHT_CACHE``: cache dequantized GGUF weights on disk (default on)."""
    return _flag("AGENT_INFER_WEIGHT_CACHE", True)


def async_scheduling() -> bool:
    """``AGENT_INFER_ASYNC_SCHEDULING``: overlap mask filling with the forward pass (default on)."""
    return _flag("AGENT_INFER_ASYNC_SCHEDULING", True)


_SPECULATIVE_SOURCES = ("auto", "mtp", "ngram", "off")


def speculative_source() -> str:
    """``AGENT_INFER_SPECULATIVE_SOURCE``: draft sources when ``EngineConfig.speculative_source`` is
    None: ``auto`` (default: MTP where the checkpoint has MTP layers, else prompt lookup), ``mtp``,
    ``ngram`` or ``off``."""
    value = _get("AGENT_INFER_SPECULATIVE_SOURCE", "auto").lower()
    if value not in _SPECULATIVE_SOURCES:
        raise ConfigError(
            f"AGENT_INFER_SPECULATIVE_SOURCE={value!r}; expected one of {', '.join(_SPECULATIVE_SOURCES)}"
        )
    return value


#: Default size of the MTP draft vocabulary (``AGENT_INFER_SPECULATIVE_DRAFT_VOCAB``).
DEFAULT_DRAFT_VOCAB = 16384


def speculative_draft_vocab() -> int:
    """``AGENT_INFER_SPECULATIVE_DRAFT_VOCAB``: how many of the most frequent token ids the MTP draft
    head chooses from when ``EngineConfig.speculative_draft_vocab`` is None (default 16384; 0 = the
    whole vocabulary)."""
    return _int("AGENT_INFER_SPECULATIVE_DRAFT_VOCAB", DEFAULT_DRAFT_VOCAB)


def num_threads() -> int:
    """``AGENT_INFER_NUM_THREADS``: torch intra-op threads; 0 keeps torch's default."""
    return _int("AGENT_INFER_NUM_THREADS", 0)


def cp_prefill_threshold() -> int:
    """``AGENT_INFER_CP_PREFILL_THRESHOLD``: a data-parallel engine prefills a prompt with at least
    this many tokens still to compute over all its ranks (context parallelism); 0 (default) never.
    ``ParallelConfig.cp_prefill_threshold`` overrides it."""
    return _int("AGENT_INFER_CP_PREFILL_THRESHOLD", 0)


def native_linear() -> bool:
    """``AGENT_INFER_NATIVE_LINEAR``: GGUF models on the CPU in float32 keep packed weights for the
    native batch-invariant kernel, and DeepSeek HF folders pack their float32 weights for it
    (default on); off runs float32 torch matmuls."""
    return _flag("AGENT_INFER_NATIVE_LINEAR", True)


_LINEAR_ACTIVATIONS = ("q8", "f32")


def linear_activations() -> str:
    """``AGENT_INFER_LINEAR_ACTIVATIONS``: q8 | f32 (default q8). With the native kernel, q8 quantizes
    activations per block of 32 to int8 for quantized (Q8_0/Q4_0/Q4_1) weights, as llama.cpp does:
    exact integer block dot products, ~2-3x less arithmetic. f32 multiplies float32 activations by
    the exactly dequantized weights (the torch reference's values, to float rounding)."""
    value = _get("AGENT_INFER_LINEAR_ACTIVATIONS", "q8").lower()
    if value not in _LINEAR_ACTIVATIONS:
        raise ConfigError(
            f"AGENT_INFER_LINEAR_ACTIVATIONS={value!r}; expected one of {', '.join(_LINEAR_ACTIVATIONS)}"
        )
    return value


_FP8_WEIGHTS = ("auto", "dequantize", "keep")


def fp8_weights() -> str:
    """``AGENT_INFER_FP8_WEIGHTS``: auto | dequantize | keep (default auto). How a block-FP8 HF
    checkpoint's projections are held: auto keeps them in FP8 where the accelerator runs FP8
    matmuls (and dequantizes at load elsewhere, the CPU included); dequantize always converts them
    at load; keep holds them in FP8 wherever an FP8 matmul runs, the CPU's slow torch kernel included."""
    value = _get("AGENT_INFER_FP8_WEIGHTS", "auto").lower()
    if value not in _FP8_WEIGHTS:
        raise ConfigError(f"AGENT_INFER_FP8_WEIGHTS={value!r}; expected one of {', '.join(_FP8_WEIGHTS)}")
    return value


def json_schema_max_seconds() -> float:
    """``AGENT_INFER_JSON_SCHEMA_MAX_SECONDS``: time limit of one JSON Schema lowering (default 5).

    Past it the front end raises ``GrammarLimitError``: schemas whose conditional branches multiply
    (nested ``if``/``then``/``else`` under ``anyOf``) would otherwise run into the rule-count limit
    only after many seconds.
    """
    raw = _get("AGENT_INFER_JSON_SCHEMA_MAX_SECONDS", "5")
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"AGENT_INFER_JSON_SCHEMA_MAX_SECONDS={raw!r} is not a number") from None
    if not value >= 0:
        raise ConfigError(f"AGENT_INFER_JSON_SCHEMA_MAX_SECONDS={value} must be >= 0")
    return value


def grammar_threads() -> int:
    """``AGENT_INFER_GRAMMAR_THREADS``: threads for batch mask fills; 0 means one per core."""
    return _int("AGENT_INFER_GRAMMAR_THREADS", 0)


def grammar_spin_us() -> int:
    """``AGENT_INFER_GRAMMAR_SPIN_US``: how long batch-fill threads poll before blocking (default 1000).

    Inside a batch fill, a thread waiting for other threads' rows or walk parts polls for up to this
    long; between batch fills, pool threads poll only while fills have been arriving less than this
    far apart (a tight fill loop), so a fill once per forward pass of several ms never polls. 0 =
    always block (a wake-up costs tens of µs on virtual machines)."""
    return _int("AGENT_INFER_GRAMMAR_SPIN_US", 1000)


_MASK_BACKENDS = ("auto", "cpu", "torch", "triton", "cuda")


def mask_backend() -> str:
    """``AGENT_INFER_MASK_BACKEND``: auto | cpu | torch | triton | cuda, the kernel that applies token
    bitmasks to logits (default auto: C++ on CPU float32, Triton then CUDA on NVIDIA, torch elsewhere)."""
    value = _get("AGENT_INFER_MASK_BACKEND", "auto").lower()
    if value not in _MASK_BACKENDS:
        raise ConfigError(f"AGENT_INFER_MASK_BACKEND={value!r}; expected one of {', '.join(_MASK_BACKENDS)}")
    return value


def api_key() -> str | None:
    """``AGENT_INFER_API_KEY``: the key ``agent-infer serve`` requires as ``Authorization: Bearer`` (unset: none)."""
    value = _get("AGENT_INFER_API_KEY", "")
    return value or None


def gc_freeze() -> bool:
    """``AGENT_INFER_GC_FREEZE``: freeze the start-up heap once the server's engine is loaded (default on)."""
    return _flag("AGENT_INFER_GC_FREEZE", True)


def native_library() -> Path | None:
    """``AGENT_INFER_NATIVE_LIBRARY``: a separately built ``_native`` extension file to load instead of
    the installed one (``make test-asan`` points it at the sanitized build). Unset: the installed one."""
    value = _get("AGENT_INFER_NATIVE_LIBRARY", "")
    return Path(value) if value else None
