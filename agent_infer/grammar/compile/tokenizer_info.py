"""Token id -> byte string tables for the grammar engine (byte-level BPE, SentencePiece, raw bytes).

Every token is reduced to the bytes it contributes to the output text. Special tokens contribute
nothing the grammar can produce (empty bytes): they are never allowed, except the EOS ids, which the
matcher allows exactly when the grammar can terminate. Added tokens a tokenizer does not mark special
(Gemma's runs of spaces, newlines and tabs, HTML tags, Qwen's ``<tool_call>``) are text: the tokenizer
turns that text into them, so a grammar allows them wherever it allows the text, as llama.cpp does for
its user-defined tokens. Non-special added tokens that look like control markers by llama.cpp's GGUF
conversion convention (``<|...|>``, ``<｜...｜>``, ``<unused...>``, ``<pad>``, ``<mask>``) stay out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from agent_infer.errors import TokenizerError
from agent_infer.native import load_native

_EOS_NAMES = (
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "</s>",
    "<eos>",
    "<｜end▁of▁sentence｜>",
    "<|end|>",
)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable-unicode stand-ins for raw bytes, inverted (char -> byte)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _byte_level_bytes(token: str) -> bytes | None:
    table = _byte_decoder()
    try:
        return bytes(table[ch] for ch in token)
    except KeyError:
        return None


# Added tokens left non-special by their tokenizer that are control markers all the same (llama.cpp's
# converter stores these as control tokens in GGUF files).
_CONTROL_LOOKING = frozenset({"<pad>", "<mask>", "<2mass>", "[@BOS@]"})


def _looks_like_control(text: str) -> bool:
    return (
        text in _CONTROL_LOOKING
        or (text.startswith("<|") and text.endswith("|>"))
        or (text.startswith("<｜") and text.endswith("｜>"))
        or (text.startswith("<unused") and text.endswith(">"))
    )


def _sentencepiece_bytes(token: str) -> bytes:
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return token.replace("▁", " ").encode("utf-8")


def _kind(spec: dict[str, Any]) -> str:
    """'byte_level' or 'sentencepiece', read from the tokenizer.json's decoder/pre-tokenizer."""
    found: list[str] = []

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            kind = node.get("type")
            if isinstance(kind, str):
                found.append(kind)
            if kind == "Replace" and "▁" in json.dumps(node.get("pattern", ""), ensure_ascii=False):
                found.append("Metaspace")
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(spec.get("decoder"))
    visit(spec.get("pre_tokenizer"))
    if "ByteLevel" in found:
        return "byte_level"
    if "Metaspace" in found or "ByteFallback" in found:
        return "sentencepiece"
    model = spec.get("model") or {}
    if model.get("byte_fallback"):
        return "sentencepiece"
    raise TokenizerError(
        f"unsupported tokenizer kind (decoder/pre-tokenizer types {sorted(set(found))}); "
        "byte-level BPE and SentencePiece tokenizers are supported"
    )


class TokenizerInfo:
    """Per-token byte strings, vocabulary size and EOS ids of one tokenizer, plus its native tables.

    Build with :meth:`from_tokenizer` or :meth:`bytes_only`. Instances are immutable and shared by
    every grammar compiled for the tokenizer (the native side caches per-state token masks here;
    the first GrammarCompiler built for it precomputes the common JSON string contents, see
    :mod:`agent_infer.grammar.compile.warmup`).
    """

    def __init__(
        self,
        token_bytes: Sequence[bytes],
        *,
        vocab_size: int | None = None,
        eos_token_ids: Sequence[int] = (),
        encode: Callable[[str], list[int]] | None = None,
    ) -> None:
        """Use the given per-id byte strings (empty = never produced by text)."""
        size = len(token_bytes) if vocab_size is None else vocab_size
        if size < len(token_bytes):
            raise TokenizerError(
                f"vocab_size={size} is smaller than the tokenizer's {len(token_bytes)} tokens"
            )
        eos = tuple(int(e) for e in eos_token_ids)
        for e in eos:
            if not 0 <= e < size:
                raise TokenizerError(f"EOS id {e} is outside the vocabulary of {size} tokens")
        # A tuple of bytes is untracked by Python's cyclic GC after its first pass; a list of the
        # whole vocabulary would be traversed again by every full collection (tens of ms). A tuple
        # of bytes is kept as given: a new one of 129k items would be traversed once more.
        self._token_bytes: tuple[bytes, ...] = (
            token_bytes
            if type(token_bytes) is tuple and all(type(b) is bytes for b in token_bytes)
            else tuple(bytes(b) for b in token_bytes)
        )
        self._vocab_size = size
        self._eos = eos
        self._encode = encode
        self._native = load_native().TokenizerInfo(list(self._token_bytes), size, list(eos))

    # -- construction --

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Any,
        *,
        vocab_size: int | None = None,
        eos_token_ids: Sequence[int] | None = None,
        text_special_tokens: Sequence[str] = (),
    ) -> TokenizerInfo:
        """From a ``tokenizers.Tokenizer``, a Hugging Face (transformers) tokenizer, or a tokenizer.json path.

        ``vocab_size`` may exceed the tokenizer's (padded model vocabularies); the extra ids are
        always masked. ``eos_token_ids`` defaults to the tokenizer's EOS token.
        ``text_special_tokens``: contents of added/special tokens (e.g. a tool-call marker) that
        stand for their own text, so a grammar whose text reaches them allows them. Off by
        default: otherwise free text (a JSON string) could smuggle in control tokens.
        """
        import tokenizers

        hf_eos: list[int] = []
        if isinstance(tokenizer, str | os.PathLike):
            try:
                backend = tokenizers.Tokenizer.from_file(str(tokenizer))
            except Exception as exc:  # the tokenizers library raises plain Exceptions
                raise TokenizerError(f"cannot read tokenizer file {tokenizer}: {exc}") from exc
        elif isinstance(tokenizer, tokenizers.Tokenizer):
            backend = tokenizer
        elif getattr(tokenizer, "backend_tokenizer", None) is not None:
            backend = tokenizer.backend_tokenizer
            eos_id = getattr(tokenizer, "eos_token_id", None)
            if isinstance(eos_id, int):
                hf_eos.append(eos_id)
        else:
            raise TokenizerError(
                f"unsupported tokenizer object {type(tokenizer).__name__}; pass a tokenizers.Tokenizer, "
                "a fast transformers tokenizer, or a tokenizer.json path"
            )
        spec = json.loads(backend.to_str())
        kind = _kind(spec)
        vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
        added: set[int] = set()
        added_text: dict[int, str] = {}
        for t in spec.get("added_tokens", []):
            content = str(t.get("content", ""))
            if t.get("special", True) or not content or _looks_like_control(content):
                added.add(int(t["id"]))
            else:
                added_text[int(t["id"])] = content
        unk = (spec.get("model") or {}).get("unk_token")
        if isinstance(unk, str) and unk in vocab:
            added.add(vocab[unk])  # the unknown-token placeholder is not text either
            added_text.pop(vocab[unk], None)
        n = max(vocab.values(), default=-1) + 1
        table: list[bytes] = [b""] * n
        as_text = set(text_special_tokens)
        missing = as_text - set(vocab)
        if missing:
            raise TokenizerError(f"text_special_tokens not in the vocabulary: {sorted(missing)}")
        for text, idx in vocab.items():
            if idx in added:
                if text in as_text:
                    table[idx] = text.encode("utf-8")
                continue
            if idx in added_text:
                # the content is the text itself (never byte-level encoded); SentencePiece added
                # tokens may spell spaces as the metaspace character, which the decoder turns back
                content = added_text[idx]
                table[idx] = (
                    content.replace("▁", " ").encode("utf-8")
                    if kind == "sentencepiece"
                    else content.encode("utf-8")
                )
                continue
            if kind == "byte_level":
                raw = _byte_level_bytes(text)
                table[idx] = raw if raw is not None else b""
            else:
                table[idx] = _sentencepiece_bytes(text)
        if eos_token_ids is None:
            eos = hf_eos or [vocab[name] for name in _EOS_NAMES if name in vocab][:1]
        else:
            eos = [int(e) for e in eos_token_ids]

        def encode(text: str) -> list[int]:
            return list(backend.encode(text, add_special_tokens=False).ids)

        return cls(table, vocab_size=vocab_size or n, eos_token_ids=eos, encode=encode)

    @classmethod
    def bytes_only(cls) -> TokenizerInfo:
        """A 257-token vocabulary: token ``b`` is the single byte ``b``; token 256 is EOS (for grammar tests)."""

        def encode(text: str) -> list[int]:
            return list(text.encode("utf-8"))

        return cls([bytes([b]) for b in range(256)] + [b""], eos_token_ids=(256,), encode=encode)

    # -- access --

    @property
    def vocab_size(self) -> int:
        """Number of token ids (bitmask width is ``ceil(vocab_size / 32)`` words)."""
        return self._vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end generation; allowed exactly when the grammar can terminate."""
        return self._eos

    @property
    def decoded_vocab(self) -> list[bytes]:
        """Byte string of every id below the tokenizer's own size (empty for special tokens)."""
        return list(self._token_bytes)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token ``token_id`` adds to the text (empty for special, padding and EOS ids)."""
        if not 0 <= token_id < self._vocab_size:
            raise IndexError(f"token id {token_id} outside the vocabulary of {self._vocab_size}")
        if token_id >= len(self._token_bytes) or token_id in self._eos:
            return b""
        return self._token_bytes[token_id]

    def byte_token(self, byte: int) -> int | None:
        """The id of a token that is exactly the single byte ``byte`` (None if there is none)."""
        table = self.__dict__.get("_byte_tokens")
        if table is None:
            found: dict[int, int] = {}
            for tid, data in enumerate(self._token_bytes):
                if len(data) == 1 and tid not in self._eos and data[0] not in found:
                    found[data[0]] = tid
            table = self.__dict__.setdefault("_byte_tokens", found)
        return table.get(byte)

    def encode(self, text: str) -> list[int]:
        """Canonical tokenization of ``text`` without special tokens (empty if unknown)."""
        return self._encode(text) if self._encode is not None else []

    def __repr__(self) -> str:
        return f"TokenizerInfo(vocab_size={self._vocab_size}, eos_token_ids={self._eos})"
