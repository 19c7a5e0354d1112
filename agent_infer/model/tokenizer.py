"""Tokenizer wrapper (``tokenizers`` backend) built from GGUF metadata or an HF directory, plus chat templates."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from agent_infer.errors import TokenizerError, UnsupportedModelError


class UnsupportedTokenizerError(UnsupportedModelError, TokenizerError):
    """The model's tokenizer kind (e.g. a GGUF SentencePiece vocab or an unknown pre-tokenizer) is not implemented."""


# Tokens that end an assistant turn in common chat templates; HF generation configs list them as EOS.
_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|end_of_text|>")

# GGUF token_type values (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# llama.cpp groups these `pre` types: single digits split off first, then the GPT-2 regex
_DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva")
_GPT2_PRE = ("default", "gpt-2", "gpt2", "mpt", "olmo", "jais")


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The HF equivalent of llama.cpp's pre-tokenizer regexes for a GGUF ``tokenizer.ggml.pre`` value."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGIT_SPLIT_PRE:
        digits = pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated")
        return pre_tokenizers.Sequence([digits, byte_level])
    regex = {"llama-bpe": _LLAMA3_REGEX, "llama3": _LLAMA3_REGEX, "qwen2": _QWEN2_REGEX}.get(pre)
    if regex is None:
        raise UnsupportedTokenizerError(f"unsupported GGUF pre-tokenizer {pre!r}")
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def _sentencepiece_bpe(tokens: list[str]) -> tuple[HFTokenizer, list[str]]:
    """A SentencePiece BPE vocabulary (``tokenizer.ggml.model == "llama"``) with byte fallback.

    Whitespace-only tokens are spelled with real spaces in some files (Gemma's) while the model sees
    ``▁``: they are respelled. Files without merges imply them: every split of a token into two
    vocabulary pieces, ranked by the token's position in the file (Gemma's scores do not follow its
    merge order; its positions do), longer left pieces first. Returns the tokenizer and the spelling.
    """
    spelled = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {tok: i for i, tok in enumerate(spelled)}
    merges = [
        (tok[:k], tok[k:])
        for tok in spelled
        for k in range(len(tok) - 1, 0, -1)
        if tok[:k] in vocab and tok[k:] in vocab
    ]
    tk = HFTokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    )
    tk.normalizer = normalizers.Replace(" ", "\u2581")
    tk.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return tk, spelled


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # HF's tojson: no HTML escaping (jinja's builtin escapes <, >, &), unicode kept as is
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class Tokenizer:
    """Text <-> token ids, special tokens and chat-template rendering for one model."""

    def __init__(
        self,
        hf_tokenizer: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
    ) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template
        eos = list(dict.fromkeys(int(i) for i in eos_token_ids))
        # ChatML-style models end a turn with a token that is not the file's EOS: stop on it too
        if chat_template:
            for tok in _END_OF_TURN:
                tid = hf_tokenizer.token_to_id(tok)
                if tok in chat_template and tid is not None and tid not in eos:
                    eos.append(tid)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        added = hf_tokenizer.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._template: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        """Number of token ids (including added tokens)."""
        return int(self.hf_tokenizer.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are recognized as such."""
        return list(self.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 byte sequences become U+FFFD."""
        return str(self.hf_tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens))

    def token_str(self, token_id: int) -> str | None:
        """The vocabulary string of one id (byte-level form for BPE), or None when out of range."""
        return self.hf_tokenizer.id_to_token(int(token_id))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's Jinja chat template (sandboxed, HF-compatible globals)."""
        if not self.chat_template:
            raise TokenizerError("this model has no chat template; pass a prompt string instead")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            try:
                self._template = env.from_string(self.chat_template)
            except jinja2.TemplateError as exc:
                raise TokenizerError(f"chat template does not compile: {exc}") from exc
        special = {}
        if self.bos_token_id is not None:
            special["bos_token"] = self.token_str(self.bos_token_id) or ""
        if self.eos_token_ids:
            special["eos_token"] = self.token_str(self.eos_token_ids[0]) or ""
        context = {**special, **kwargs}
        try:
            return self._template.render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template failed to render: {exc}") from exc

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], source: str = "GGUF file") -> Tokenizer:
        """Build a tokenizer from ``tokenizer.ggml.*`` metadata: byte-level BPE (``gpt2``) or
        SentencePiece BPE with byte fallback (``llama``, merges implied by the vocabulary)."""
        kind = meta.get("tokenizer.ggml.model")
        if kind not in ("gpt2", "llama"):
            raise UnsupportedTokenizerError(
                f"{source}: tokenizer.ggml.model={kind!r} is not supported "
                "(byte-level BPE 'gpt2' and SentencePiece BPE 'llama')"
            )
        tokens: list[str] | None = meta.get("tokenizer.ggml.tokens")
        merges: list[str] | None = meta.get("tokenizer.ggml.merges")
        if not tokens or (merges is None and kind == "gpt2"):
            raise TokenizerError(
                f"{source}: GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges"
            )
        types = meta.get("tokenizer.ggml.token_type")
        types_arr = np.asarray(types if types is not None else np.ones(len(tokens)), dtype=np.int64)
        if kind == "llama":
            if merges is not None or meta.get("tokenizer.ggml.add_space_prefix", False):
                raise UnsupportedTokenizerError(
                    f"{source}: SentencePiece vocabularies with stored merges or a space prefix are not supported"
                )
            tk, tokens = _sentencepiece_bpe(list(tokens))
        else:
            vocab = {tok: i for i, tok in enumerate(tokens)}
            pairs = []
            for m in merges or ():
                a, sep, b = m.partition(" ")
                if not sep:
                    raise TokenizerError(f"{source}: malformed BPE merge {m!r}")
                pairs.append((a, b))
            tk = HFTokenizer(
                models.BPE(
                    vocab=vocab, merges=pairs, ignore_merges=meta.get("tokenizer.ggml.pre") == "llama-bpe"
                )
            )
            tk.pre_tokenizer = _byte_level_pre_tokenizer(str(meta.get("tokenizer.ggml.pre", "default")))
            tk.decoder = decoders.ByteLevel()
        special_ids = np.nonzero((types_arr == _CONTROL) | (types_arr == _USER_DEFINED))[0].tolist()
        tk.add_tokens(
            [
                AddedToken(tokens[i], special=bool(types_arr[i] == _CONTROL), normalized=False)
                for i in special_ids
            ]
        )
        bos = meta.get("tokenizer.ggml.bos_token_id")
        bos = None if bos is None else int(bos)
        if bos is not None and bool(meta.get("tokenizer.ggml.add_bos_token", False)):
            bos_tok = tokens[bos]
            tk.post_processor = processors.TemplateProcessing(
                single=f"{bos_tok} $A", pair=f"{bos_tok} $A {bos_tok} $B", special_tokens=[(bos_tok, bos)]
            )
        eos = meta.get("tokenizer.ggml.eos_token_id")
        return cls(
            tk,
            bos_token_id=bos,
            eos_token_ids=() if eos is None else (int(eos),),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(
        cls,
        directory: str | Path,
        extra_eos_ids: Sequence[int] = (),
        *,
        fallback_dir: Path | None = None,
        default_chat_template: str | None = None,
    ) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``) from an HF directory.

        ``fallback_dir`` supplies both tokenizer files when ``directory`` has no ``tokenizer.json``
        (a ``tokenizer_config.json`` of ``directory`` still wins); ``default_chat_template`` is used
        when neither names a template.
        """
        d = Path(directory)
        path = d / "tokenizer.json"
        if fallback_dir is not None and not path.is_file():
            path = fallback_dir / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{d}: no tokenizer.json (only fast tokenizers are supported)")
        try:
            tk = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises plain Exception on bad JSON
            raise TokenizerError(f"{path}: cannot read tokenizer: {exc}") from exc
        cfg: dict[str, Any] = {}
        cfg_path = d / "tokenizer_config.json"
        if fallback_dir is not None and not cfg_path.is_file():
            cfg_path = fallback_dir / "tokenizer_config.json"
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{cfg_path}: invalid JSON: {exc}") from exc
        template = cfg.get("chat_template")
        if isinstance(template, list):  # HF allows named templates; use the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_path = d / "chat_template.jinja"
        if template is None and jinja_path.is_file():
            template = jinja_path.read_text(encoding="utf-8")
        if template is None:
            template = default_chat_template

        def token_id(key: str) -> int | None:
            value = cfg.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return tk.token_to_id(value) if isinstance(value, str) else None

        eos = [i for i in (token_id("eos_token"), *extra_eos_ids) if i is not None]
        return cls(tk, bos_token_id=token_id("bos_token"), eos_token_ids=eos, chat_template=template)
