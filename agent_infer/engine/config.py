"""Engine-wide settings: KV cache geometry, batching limits, dtype and device."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from agent_infer import envs
from agent_infer.errors import ConfigError

_SOURCES = ("auto", "mtp", "ngram", "off")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class EngineConfig:
    """Settings fixed for the lifetime of an :class:`~agent_infer.engine.llm_engine.LLMEngine`.

    The KV pool is ``num_kv_blocks`` blocks of ``block_size`` tokens when given; otherwise as many
    blocks as fit in ``kv_cache_memory_bytes``. ``max_model_len`` of None means the model's own
    context length. ``accelerator`` of None defers to ``AGENT_INFER_ACCELERATOR``.

    Structured generation: ``async_scheduling`` fills grammar bitmasks on a background thread
    while the forward pass runs (None defers to ``AGENT_INFER_ASYNC_SCHEDULING``, default on);
    ``forced_tokens`` appends the tokens a grammar fixes without sampling them (jump-forward);
    ``boundary_drafts`` (with ``forced_tokens``) feeds the forced text's last tokens, which
    jump-forward leaves to the model because their boundary could still move, as a draft verified
    in the same pass; ``masked_head`` lets the output projection skip the weights of tokens the
    grammars of a step's rows all exclude (packed CPU head only; logits stay bit-identical);
    ``grammar_workers`` is the size of the pool that compiles request grammars.

    Batching: a step feeds at most ``max_num_batched_tokens`` tokens; while any request decodes,
    prompt chunks take at most ``max_prefill_tokens_while_decoding`` of them, so a long prompt is
    prefilled over many short steps and the decoding streams keep receiving tokens (a step's time
    grows with its tokens, and each decoding stream waits for the whole step).

    Speculative decoding (``engine/speculator.py``): ``speculative_tokens`` is the longest
    guessed draft verified per request and step (0 = off; default 5, as DeepInfer's; at most 32);
    ``speculative_source`` picks the draft sources (``"auto"``: the checkpoint's MTP layers where it
    has them, plus prompt lookup; ``"mtp"``; ``"ngram"``: prompt lookup; ``"off"``; None defers to
    ``AGENT_INFER_SPECULATIVE_SOURCE``, default ``"auto"``); ``speculative_confidence`` (in [0, 1])
    is the base of the MTP confidence threshold (``engine/drafts/schedule.py``);
    ``speculative_draft_vocab`` is how many token ids the MTP draft head chooses from (the most
    frequent; 0 or at least the vocabulary size = all of them; ``engine/drafts/vocab.py``; None
    defers to ``AGENT_INFER_SPECULATIVE_DRAFT_VOCAB``, default 16,384).

    Second KV tier (``engine/kv_tier.py``): ``host_kv_cache_bytes`` of host memory keep the prefix
    blocks the device pool evicts, and a later prefix hit copies them back instead of recomputing
    them (0 = off; with prefix caching off there is nothing to keep, so it must stay 0).
    """

    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int = 512 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_prefill_tokens_while_decoding: int = 16
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    accelerator: str | None = None
    async_scheduling: bool | None = None
    forced_tokens: bool = True
    boundary_drafts: bool = True
    masked_head: bool = True
    grammar_workers: int = 2
    speculative_tokens: int = 5
    host_kv_cache_bytes: int = 0
    speculative_source: str | None = None
    speculative_confidence: float = 0.05
    speculative_draft_vocab: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "kv_cache_memory_bytes",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_prefill_tokens_while_decoding",
        ):
            _positive_int(name, getattr(self, name))
        if self.num_kv_blocks is not None:
            _positive_int("num_kv_blocks", self.num_kv_blocks)
        if self.max_model_len is not None:
            _positive_int("max_model_len", self.max_model_len)
        _positive_int("grammar_workers", self.grammar_workers)
        if isinstance(self.host_kv_cache_bytes, bool) or not isinstance(self.host_kv_cache_bytes, int):
            raise ConfigError(f"host_kv_cache_bytes must be an int, got {self.host_kv_cache_bytes!r}")
        if self.host_kv_cache_bytes < 0:
            raise ConfigError(f"host_kv_cache_bytes must be >= 0, got {self.host_kv_cache_bytes}")
        if self.host_kv_cache_bytes and self.enable_prefix_caching is False:
            raise ConfigError(
                "host_kv_cache_bytes needs enable_prefix_caching (the tier keeps cached prefixes)"
            )
        if isinstance(self.speculative_tokens, bool) or not isinstance(self.speculative_tokens, int):
            raise ConfigError(f"speculative_tokens must be an int, got {self.speculative_tokens!r}")
        if not 0 <= self.speculative_tokens <= 32:
            raise ConfigError(f"speculative_tokens must be in [0, 32], got {self.speculative_tokens}")
        if self.speculative_source is not None and self.speculative_source not in _SOURCES:
            raise ConfigError(
                f"speculative_source={self.speculative_source!r}; expected one of {', '.join(_SOURCES)}"
            )
        conf = self.speculative_confidence
        if isinstance(conf, bool) or not isinstance(conf, (int, float)) or not 0.0 <= conf <= 1.0:
            raise ConfigError(f"speculative_confidence must be a number in [0, 1], got {conf!r}")
        vocab = self.speculative_draft_vocab
        if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 0):
            raise ConfigError(
                f"speculative_draft_vocab must be an integer >= 0 (0 = the whole vocabulary), got {vocab!r}"
            )
        for name in ("enable_prefix_caching", "forced_tokens", "boundary_drafts"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise ConfigError("async_scheduling must be a bool or None")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype={self.dtype!r}; expected one of {', '.join(_DTYPES)}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments; an unknown key raises :class:`ConfigError` naming it."""
        known = {f.name for f in dataclasses.fields(cls)}
        for key in kwargs:
            if key not in known:
                raise ConfigError(f"unknown engine option {key!r}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)

    @property
    def use_async_scheduling(self) -> bool:
        """Whether the mask fill overlaps the forward pass (the field, else the environment)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return envs.async_scheduling()

    @property
    def speculative_source_resolved(self) -> str:
        """The draft sources (the field, else the environment)."""
        if self.speculative_source is not None:
            return self.speculative_source
        return envs.speculative_source()

    @property
    def speculative_draft_vocab_resolved(self) -> int:
        """The MTP draft vocabulary's size (the field, else the environment; 0 = the whole vocabulary)."""
        if self.speculative_draft_vocab is not None:
            return self.speculative_draft_vocab
        return envs.speculative_draft_vocab()

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of weights, activations and the KV cache."""
        return _DTYPES[self.dtype]


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
