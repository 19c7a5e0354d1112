"""Native lowering through the fragment store: right-linear chains and long counted repeats.

``grammar/lower/fragment_store.cpp`` keeps the automata of inlined rules as one hash-consed store of
acyclic DFA states, built from the programs right to left, so a chain of rules (a ``pattern``
under ``maxLength``: one rule per position) costs each rule its own states, and
``grammar/lower/inline.cpp`` inlines such a chain whole into its one caller instead of cutting it
where its expanded size gets large (every rule at such a cut would copy the whole tail). Finite
rules with long counted repeats (``char{0,255}``) are lowered through the store as well. These
tests check the languages against Python's ``re`` on many strings, the token masks against
``accept_token``, and pin the chain's state count.
"""

from __future__ import annotations

import json
import random
import re

import pytest
from grammar_support import assert_mask_exact, hf_tokenizer, tokenizer_info

from agent_infer.errors import GrammarLimitError
from agent_infer.grammar.compile.compiler import CompiledGrammar, GrammarCompiler
from agent_infer.grammar.compile.tokenizer_info import TokenizerInfo
from agent_infer.grammar.ir import Expr, Grammar, Ref, Repeat, alt, chars, lit, seq
from agent_infer.grammar.runtime.matcher import GrammarMatcher

CURIE = r"^([a-z0-9-]+):([a-z0-9\.-]+):([a-z0-9-]+)?:([a-z0-9-]+)$"


def _compile(grammar: Grammar, info: TokenizerInfo | None = None) -> CompiledGrammar:
    return GrammarCompiler(info or TokenizerInfo.bytes_only(), cache_enabled=False).compile(grammar)


def _accepts(compiled: CompiledGrammar, text: str) -> bool:
    m = GrammarMatcher(compiled)
    return m.accept_string(text) and m.can_terminate()


def _curie_samples(rng: random.Random, n: int) -> list[str]:
    """Strings near the curie language: mostly valid shapes of every length, some broken."""
    alphabet = "ab9-.:"
    out = ["", ":", "::", ":::", "a:b::c", "a:b:c:d", "a::c:d", "a:b:c:", "a.b:c:d:e"]
    for _ in range(n):
        if rng.random() < 0.6:
            parts = [
                "".join(rng.choice("az09-") for _ in range(rng.randint(1, 14))),
                "".join(rng.choice("az09-.") for _ in range(rng.randint(1, 14))),
                "".join(rng.choice("az09-") for _ in range(rng.randint(0, 14))),
                "".join(rng.choice("az09-") for _ in range(rng.randint(1, 14))),
            ]
            s = ":".join(parts)
        else:
            s = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 50)))
        out.append(s)
    return out


def test_pattern_under_max_length_is_exact() -> None:
    """The curie pattern under maxLength (one front-end rule per position of its counted
    automaton) accepts exactly the strings that match and fit."""
    limit = 40
    schema = {"type": "string", "pattern": CURIE, "maxLength": limit}
    compiled = _compile(Grammar.from_json_schema(schema, whitespace="compact"))
    rx = re.compile(CURIE)
    rng = random.Random(7)
    samples = _curie_samples(rng, 600)
    # Lengths around the bound, valid shapes.
    for k in range(limit - 3, limit + 3):
        samples.append("a:" + "b" * (k - 6) + ":c:d")
    accepted = 0
    for s in samples:
        want = bool(rx.search(s)) and len(s) <= limit
        assert _accepts(compiled, json.dumps(s)) == want, s
        accepted += want
    assert 100 < accepted < len(samples)


def test_chain_is_inlined_once() -> None:
    """The chain's positions become one automaton: a few states per position of the counted
    automaton, not a copy of the chain's tail per position near the cut."""
    schema = {"type": "string", "pattern": CURIE, "maxLength": 146}
    grammar = Grammar.from_json_schema(schema, whitespace="compact")
    compiled = _compile(grammar)
    # ≈ 1 000 rules (positions x pattern states: 1 411 before the pattern's automaton merged its
    # equivalent final states); with the tail copied per rule at the cut: 11 306 states.
    assert len(grammar.rules) > 900
    assert compiled.num_states < 2 * len(grammar.rules), compiled.num_states
    assert _accepts(compiled, json.dumps("a:" + "b" * 140 + ":c:d"))
    assert not _accepts(compiled, json.dumps("a:" + "b" * 141 + ":c:d"))


def test_long_counted_string_is_exact() -> None:
    """maxLength above the inlining bound (a counted repeat of the inlined JSON character,
    lowered in the store): escapes, surrogate pairs and multi-byte characters count as one."""
    schema = {"type": "string", "minLength": 2, "maxLength": 300}
    compiled = _compile(Grammar.from_json_schema(schema, whitespace="compact"))
    pieces = ["a", "\u00e9", "\u65e5", "\U0001f600", '"', "\\", "\n", "\u0001"]
    rng = random.Random(3)
    for n in [0, 1, 2, 3, 150, 299, 300, 301, 320]:
        text = "".join(rng.choice(pieces) for _ in range(n))
        assert _accepts(compiled, json.dumps(text)) == (2 <= n <= 300), n
        assert _accepts(compiled, json.dumps(text, ensure_ascii=False)) == (2 <= n <= 300), n
    assert not _accepts(compiled, '"ab\\x"')
    assert not _accepts(compiled, '"ab\\ud800"')  # a lone high surrogate


def _regex_samples(rng: random.Random, alphabet: str, n: int, max_len: int) -> list[str]:
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, max_len))) for _ in range(n)]


def test_overlapping_counted_alternatives_are_exact() -> None:
    """Long repeats of alternatives that share prefixes (the store's union of automata) and
    references to a separate recursive rule (reference edges in the store)."""
    nested: Expr = alt(seq(lit("("), Ref("nest"), lit(")")), lit(""))
    rules: dict[str, Expr] = {
        "root": seq(Repeat(alt(lit("ab"), lit("a"), seq(lit("b"), Ref("nest"))), 0, 45), lit("c")),
        "nest": nested,
    }
    compiled = _compile(Grammar.from_rules(rules))
    nest = r"(?:\((?:\((?:\(\))?\))?\))?"  # the samples nest at most three deep
    rx = re.compile(rf"(?:ab|a|b{nest}){{0,45}}c")
    rng = random.Random(11)
    samples = [*_regex_samples(rng, "abc()", 3000, 14), "a" * 45 + "c", "a" * 46 + "c", "ab" * 45 + "c"]
    samples += ["b(())" * 9 + "c", "b()" * 45 + "c", "b()" * 46 + "c"]
    hits = 0
    for s in samples:
        if s.count("(") > 3:
            continue
        want = rx.fullmatch(s) is not None
        assert _accepts(compiled, s) == want, s
        hits += want
    assert hits > 30


def test_chain_masks_exact() -> None:
    """Every token's bit along a document whose value is a long chained pattern string."""
    schema = {
        "type": "object",
        "properties": {"curie": {"type": "string", "pattern": CURIE, "maxLength": 60}},
        "required": ["curie"],
    }
    info = tokenizer_info("smollm2")
    compiled = GrammarCompiler(info, cache_enabled=False).compile(
        Grammar.from_json_schema(schema, whitespace="compact")
    )
    text = json.dumps({"curie": "acme-1:news.article:x9:a-b-c-d"}, separators=(",", ":"))
    ids = hf_tokenizer("smollm2").encode(text, add_special_tokens=False).ids
    m = GrammarMatcher(compiled)
    for pos, tid in enumerate(ids):
        assert_mask_exact(m, pos)
        assert m.accept_token(tid), pos
    assert m.can_terminate()


def test_long_chain_of_rules_does_not_exhaust_the_stack() -> None:
    """A finite chain thousands of rules deep (each inlined into the one before) compiles."""
    n = 3000
    rules: dict[str, Expr] = {"root": seq(Ref("r0"), lit("!"))}
    for i in range(n):
        nxt = Ref(f"r{i + 1}") if i + 1 < n else lit("")
        rules[f"r{i}"] = alt(seq(chars("a-c"), nxt), lit(""))
    compiled = _compile(Grammar.from_rules(rules))
    assert _accepts(compiled, "abc" * 100 + "!")
    assert _accepts(compiled, "!")
    assert not _accepts(compiled, "abcd!")
    assert not _accepts(compiled, "ab")
    # Matching it is another matter: byte k completes k nested rules, each scanning an Earley set
    # of O(k) items, so the work per byte grows quadratically and the per-byte budget stops it
    # (GrammarLimitError, the matcher unchanged) long before the chain's 3 000 characters.
    m = GrammarMatcher(compiled)
    with pytest.raises(GrammarLimitError, match="max_work_per_byte"):
        m.accept_string("abc" * 1000)
    assert m.num_accepted_steps == 0 and m.accept_string("abc!") and m.can_terminate()


def test_pattern_alternatives_sharing_loops_are_exact() -> None:
    """An unanchored alternation pattern (one JSON-character loop per branch before and after
    each word, built with one shared copy of each: grammar/lower/nfa_alt.cpp) accepts exactly the
    strings ``re.search`` finds it in, escapes and non-ASCII included."""
    pattern = "^dev|alpha|be+ta|RC[0-9]"
    compiled = _compile(Grammar.from_json_schema({"type": "string", "pattern": pattern}))
    rx = re.compile(pattern)
    rng = random.Random(5)
    alphabet = ["d", "e", "v", "a", "l", "p", "h", "b", "t", "R", "C", "7", "x", '"', "\\", "\u00e9", "\n"]
    samples = ["dev", "xdev", "alpha", "xxalphaxx", "beeeta", "bta", "RC", "RC5", "aRC9b", ""]
    words = ["dev", "alpha", "beeta", "RC3", "alph", "bta", "RC", "de"]

    def noise() -> str:
        return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6)))

    samples += [noise() + noise() for _ in range(800)]
    samples += [noise() + rng.choice(words) + noise() for _ in range(800)]
    hits = 0
    for s in samples:
        want = rx.search(s) is not None
        assert _accepts(compiled, json.dumps(s)) == want, s
        assert _accepts(compiled, json.dumps(s, ensure_ascii=False)) == want, s
        hits += want
    assert 200 < hits < len(samples) - 200


def test_alternatives_sharing_first_and_last_elements_are_exact() -> None:
    """Branches with the same large first and last elements (and one without them) keep their
    language when those elements are shared."""
    loop = Repeat(chars("a-ce-g"), 0, None)
    rules: dict[str, Expr] = {
        "root": alt(
            seq(loop, lit("xy"), loop),
            seq(loop, lit("z"), Ref("tail"), loop),
            seq(lit("q"), loop),
            seq(chars("0-9"), lit("w"), loop),
            lit("end"),
        ),
        "tail": alt(seq(lit("<"), Ref("tail"), lit(">")), lit("")),
    }
    compiled = _compile(Grammar.from_rules(rules))
    tail = r"(?:<(?:<(?:<>)?>)?>)?"
    rx = re.compile(rf"[a-ce-g]*xy[a-ce-g]*|[a-ce-g]*z{tail}[a-ce-g]*|q[a-ce-g]*|[0-9]w[a-ce-g]*|end")
    rng = random.Random(9)
    samples = [*_regex_samples(rng, "abexyzq5w<>nd", 4000, 10), "end", "xy", "z<<>>", "q", "5w", "azb<>c"]
    hits = 0
    for s in samples:
        if s.count("<") > 3:
            continue
        want = rx.fullmatch(s) is not None
        assert _accepts(compiled, s) == want, s
        hits += want
    assert hits > 30


def test_store_reused_after_a_big_grammar_gives_the_same_automaton() -> None:
    """The store's hash table is kept per thread and shrunk after a big grammar: a small grammar
    lowered before and after a big one (whose table grew past the shrink bound, 4 096 slots at
    most half full) gets the same states and language, so no entry of the big one survives."""
    small = {"type": "string", "pattern": "^(ab|ac|b[0-9]{2})$", "maxLength": 8}
    before = _compile(Grammar.from_json_schema(small, whitespace="compact"))
    chains = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "pattern": CURIE, "maxLength": 300},
            "b": {"type": "string", "pattern": CURIE, "maxLength": 299},
        },
    }
    big = _compile(Grammar.from_json_schema(chains, whitespace="compact"))
    assert big.num_states > 2048, big.num_states  # every one of them a state of the store
    after = _compile(Grammar.from_json_schema(small, whitespace="compact"))
    assert after.num_states == before.num_states
    for text in ["ab", "ac", "b12", "b1", "ad", "abc", "", "b123"]:
        want = text in {"ab", "ac", "b12"}
        assert _accepts(before, json.dumps(text)) == want, text
        assert _accepts(after, json.dumps(text)) == want, text
