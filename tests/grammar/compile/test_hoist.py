"""Native lowering: big repeated items become rules of their own, and copied rules stay separate.

``grammar/lower/hoist.cpp`` moves a large call-free item of a repeat (a pattern's character class with
its JSON escapes) into a rule, which is then inlined as one minimal automaton per copy instead of
being expanded as NFA states in each copy. ``demote_copied_rules`` (``grammar/lower/inline.cpp``)
keeps a rule separate when counted repeats multiply its inlined size and it is referenced more
than once (an array of enum strings with ``maxItems`` under several ``anyOf`` branches). Both
are pinned by state counts against a grammar the pass cannot apply to, with the same language;
the language and the token masks must stay exact.
"""

from __future__ import annotations

import json

from grammar_support import assert_mask_exact, hf_tokenizer, tokenizer_info

from agent_infer.grammar.compile.compiler import CompiledGrammar, GrammarCompiler
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.ir import Expr, Grammar, Ref, Repeat, alt, lit, plus, seq
from agent_infer.grammar.runtime.matcher import GrammarMatcher

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


def _compile(grammar: Grammar, info: TokenizerInfo | None = None) -> CompiledGrammar:
    return GrammarCompiler(info or TokenizerInfo.bytes_only(), cache_enabled=False).compile(grammar)


def _accepts(compiled: CompiledGrammar, text: str) -> bool:
    m = GrammarMatcher(compiled)
    return m.accept_string(text) and m.can_terminate()


def _words_grammar(blocked: bool) -> Grammar:
    """Up to 20 space-separated words; with ``blocked`` one alternative of the word is spelled
    through a reference (same language), which keeps the item from being hoisted."""
    first: Expr = Ref("alpha") if blocked else lit("alpha")
    word = alt(first, *(lit(w) for w in WORDS[1:]))
    rules: dict[str, Expr] = {"root": seq(Repeat(seq(plus(word), lit(" ")), 0, 19), plus(word))}
    if blocked:
        rules["alpha"] = lit("alpha")
    return Grammar.from_rules(rules)


def test_hoisted_item_is_one_minimal_copy_per_repeat() -> None:
    hoisted, blocked = _compile(_words_grammar(False)), _compile(_words_grammar(True))
    assert hoisted.num_states < 0.8 * blocked.num_states, (hoisted.num_states, blocked.num_states)
    cases = [
        "alpha",
        "betagamma",
        "eta theta iota",
        " ".join(WORDS * 2),
        " ".join(["kappa"] * 21),
        "alpha ",
        " alpha",
        "alpha  beta",
        "alphx",
        "alph",
        " ".join(["kappa"] * 20) + "zeta",
    ]
    for text in cases:
        assert _accepts(hoisted, text) == _accepts(blocked, text), text
    assert _accepts(hoisted, " ".join(["kappa"] * 20))
    assert not _accepts(hoisted, " ".join(["kappa"] * 21))


def test_hoisted_pattern_class_masks_exact() -> None:
    """``\\S+`` and ``\\s+`` under a counted repeat inside a JSON string (their classes carry the
    JSON escapes): every token's bit at sampled positions equals accept_token."""
    schema = {"type": "string", "pattern": "^(?:\\S+\\s+){0,9}\\S+$"}
    info = tokenizer_info("smollm2")
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(schema, whitespace="compact")
    )
    text = json.dumps('caf\u00e9 \\u00e9t\u00e9\tno\nd\u65e5 a/b "q" x y z w', ensure_ascii=False)
    tok = hf_tokenizer("smollm2")
    ids = tok.encode(text, add_special_tokens=False).ids
    m = GrammarMatcher(compiled)
    for pos, tid in enumerate(ids):
        if pos < 12 or pos % 2 == 0:
            assert_mask_exact(m, pos)
        assert m.accept_token(tid), pos
    assert m.can_terminate()
    too_many = json.dumps(" ".join("w" * 11), ensure_ascii=False)
    assert not _accepts(compiled, too_many)
    assert _accepts(compiled, json.dumps(" ".join("w" * 10)))


def _arrays_grammar(branches: int) -> Grammar:
    """``branches`` rules of their own (a loop keeps each separate) that each hold the same
    array of up to 12 enum strings."""
    item = alt(*(lit(f'"{w}-{w}"') for w in WORDS))
    rules: dict[str, Expr] = {
        "root": alt(*(Ref(f"b{i}") for i in range(branches))),
        "arr": seq(lit("["), Ref("item"), Repeat(seq(lit(","), Ref("item")), 0, 11), lit("]")),
        "item": item,
    }
    for i in range(branches):
        rules[f"b{i}"] = seq(lit(f"{i}:"), Ref("arr"), Repeat(lit("!"), 0, None))
    return Grammar.from_rules(rules)


def test_copied_rule_is_built_once() -> None:
    one, eight = _compile(_arrays_grammar(1)), _compile(_arrays_grammar(8))
    # Inlined into each branch, eight copies of the array would be about 8x one.
    assert eight.num_states < 1.5 * one.num_states, (eight.num_states, one.num_states)
    items = [f'"{w}-{w}"' for w in WORDS]
    assert _accepts(eight, "7:[" + ",".join(items[:3]) + "]!!")
    assert _accepts(eight, "3:[" + ",".join((items * 2)[:12]) + "]")
    assert not _accepts(eight, "3:[" + ",".join((items * 2)[:13]) + "]")
    assert not _accepts(eight, "8:[" + items[0] + "]")
    assert not _accepts(eight, '0:["alpha-beta"]')


def test_copied_rule_masks_exact() -> None:
    schema = {
        "anyOf": [
            {
                "type": "object",
                "properties": {"k": {"const": i}, "tags": {"$ref": "#/$defs/tags"}},
                "required": ["k"],
            }
            for i in range(4)
        ],
        "$defs": {"tags": {"type": "array", "items": {"enum": [f"{w} {w}" for w in WORDS]}, "maxItems": 12}},
    }
    info = tokenizer_info("smollm2")
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(schema, whitespace="compact")
    )
    doc = {"k": 2, "tags": [f"{w} {w}" for w in WORDS[:4]]}
    tok = hf_tokenizer("smollm2")
    ids = tok.encode(json.dumps(doc, separators=(",", ":")), add_special_tokens=False).ids
    m = GrammarMatcher(compiled)
    for pos, tid in enumerate(ids):
        assert_mask_exact(m, pos)
        assert m.accept_token(tid), pos
    assert m.can_terminate()
