"""Run-time checks (``ir.Check``): the matcher against the reference recognizer and brute force.

Each grammar below is small enough that "a prefix can be completed" is decided by brute force: a
breadth-first search over the grammar's characters, each candidate judged by the reference
recognizer's ``accepts``. Every prefix the native matcher keeps must have such a completion, and
every prefix it refuses must have none (within the search depth, which covers the grammars'
completions); its masks must equal what ``accept_token`` takes (bytes vocabulary at every
position, DeepSeek-V4 along the documents); its full-string answers must equal the recognizer's.
"""

from __future__ import annotations

import itertools

import pytest
from grammar_support import STRING, assert_mask_exact, hf_tokenizer, tokenizer_info

from agent_infer.errors import GrammarDefinitionError, GrammarLimitError
from agent_infer.grammar import Grammar, GrammarCompiler, GrammarMatcher
from agent_infer.grammar.frontends.ebnf.gbnf import parse_gbnf
from agent_infer.grammar.ir import Check, Expr, Ref, alt, chars, lit, opt, plus, seq, star
from agent_infer.grammar.ir.recognizer import ReferenceRecognizer

DIGITS = plus(chars("0-9"))
INTEGER = seq(opt(lit("-")), alt(lit("0"), seq(chars("1-9"), star(chars("0-9")))))
NUMBER = seq(INTEGER, opt(seq(lit("."), DIGITS)))


def _list(item: Expr) -> Expr:
    return seq(lit("["), item, star(seq(lit(","), item)), lit("]"))


def _obj(fields: list[tuple[str, Expr, bool]]) -> Expr:
    parts: list[Expr] = [lit("{")]
    for i, (name, value, optional) in enumerate(fields):
        item = seq(lit(f',"{name}":' if i else f'"{name}":'), value)
        parts.append(opt(item) if optional else item)
    parts.append(lit("}"))
    return seq(*parts)


# name -> (rules, characters brute force draws completions from, strings to compare on)
CASES: dict[str, tuple[dict[str, Expr], str, list[str]]] = {
    # oneOf of overlapping number languages: integers are in both, so only fractions pass.
    "one_of_numbers": (
        {
            "root": _list(Ref("c")),
            "c": Check((Ref("a"), Ref("b")), 2, (0b01, 0b10)),
            "a": INTEGER,
            "b": NUMBER,
        },
        "[0123.,]-",
        ["[1.5]", "[1]", "[1.5,2]", "[1.5,2.25]", "[0.0]", "[-3.1,10.01]"],
    ),
    # S and not N: digit strings other than 12 and 13.
    "not_listed": (
        {
            "root": _list(Ref("c")),
            "c": Check((Ref("s"), Ref("n")), 1, (0b01,)),
            "s": DIGITS,
            "n": alt(lit("12"), lit("13")),
        },
        "[0123,]",
        ["[1]", "[12]", "[123]", "[13,1]", "[131,12]", "[0]"],
    ),
    # A and B: digit strings ending in an even digit, at least two long. Every prefix A keeps
    # viable can still meet both (the contract of a check: grammar_engine.md, "Run-time checks").
    "all_of": (
        {
            "root": _list(Ref("c")),
            "c": Check((Ref("a"), Ref("b")), 1, (0b11,)),
            "a": seq(star(chars("0-9")), chars("02468")),
            "b": seq(chars("0-9"), DIGITS),
        },
        "[0123,]",
        ["[12]", "[2]", "[13]", "[10,102]", "[1]", "[20,2]"],
    ),
    # Objects: {"a": integer} is in both branches, so it needs "b" (only in A) or a fraction (only in B).
    "one_of_objects": (
        {
            "root": _list(Ref("c")),
            "c": Check((Ref("A"), Ref("B")), 2, (0b01, 0b10)),
            "A": _obj([("a", INTEGER, False), ("b", STRING, True)]),
            "B": _obj([("a", NUMBER, False)]),
        },
        '[{}"ab:1.,]x',
        ['[{"a":1.5}]', '[{"a":1}]', '[{"a":1,"b":"x"}]', '[{"a":1.5},{"a":2}]', '[{"a":2,"b":""}]'],
    ),
    # A check inside a carrier of another, and one inside a shadow: not (oneOf [int, number]).
    "nested": (
        {
            "root": _list(Ref("outer")),
            "outer": Check((Ref("s"), Ref("inner")), 1, (0b01,)),
            "s": NUMBER,
            "inner": Check((Ref("a"), Ref("b")), 2, (0b01, 0b10)),
            "a": INTEGER,
            "b": seq(DIGITS, lit("."), lit("5")),
        },
        "[0125.,]",
        ["[1]", "[1.5]", "[1.25]", "[0.5,2]", "[12.5]"],
    ),
    # oneOf at two depths: a list item is a number pair, or a list of such items (recursion).
    "recursive": (
        {
            "root": Ref("v"),
            "v": Check((Ref("p"), Ref("l")), 2, (0b01, 0b10)),
            "p": seq(lit("("), Ref("n"), lit(","), Ref("n"), lit(")")),
            "n": Check((Ref("a"), Ref("b")), 2, (0b01, 0b10)),
            "a": INTEGER,
            "b": NUMBER,
            "l": _list(Ref("v")),
        },
        "(),[]01.5",
        ["(0.5,1.5)", "[(0.5,1.5)]", "[[(0.5,0.5)],(1.5,0.5)]", "(1,0.5)", "[(1.5,1)]"],
    ),
}


def _grammar(name: str) -> Grammar:
    return Grammar.from_rules(CASES[name][0])


def _completion_found(compiled: object, rec: ReferenceRecognizer, prefix: str) -> bool:
    """Whether the native matcher's shortest completion of ``prefix`` is a string of the language
    by the reference recognizer's judgement (a completion the native side found, checked apart)."""
    m = GrammarMatcher(compiled)  # type: ignore[arg-type]
    assert m.accept_string(prefix)
    done = m.shortest_completion()
    return done is not None and rec.accepts(prefix + done.decode())


def _no_completion(rec: ReferenceRecognizer, prefix: str, alphabet: str, depth: int = 4) -> bool:
    """Whether no string of at most ``depth`` more characters completes ``prefix``, searched by the
    reference recognizer alone (its viable prefixes over-approximate completability, so pruning by
    them loses no completion)."""
    frontier = [prefix]
    for _ in range(depth + 1):
        if any(rec.accepts(p) for p in frontier):
            return False
        frontier = [p + ch for p in frontier for ch in alphabet if rec.is_prefix(p + ch)][:400]
    return True


@pytest.mark.parametrize("name", sorted(CASES))
def test_gbnf_round_trip(name: str) -> None:
    g = _grammar(name)
    assert parse_gbnf(str(g)) == g


def _candidates(texts: list[str], alphabet: str) -> list[str]:
    """Every prefix of ``texts``, then the first 1,500 strings of 1-3 ``alphabet`` characters, once each."""
    candidates = [t[:cut] for t in texts for cut in range(len(t) + 1)]
    candidates += ["".join(p) for n in range(1, 4) for p in itertools.product(alphabet, repeat=n)][:1500]
    return list(dict.fromkeys(candidates))


@pytest.mark.parametrize("name", sorted(CASES))
def test_native_agrees_with_reference_and_brute_force(name: str) -> None:
    _, alphabet, texts = CASES[name]
    g = _grammar(name)
    rec = ReferenceRecognizer(g)
    compiled = GrammarCompiler(tokenizer_info("bytes")).compile(g)
    for text in _candidates(texts, alphabet):
        m = GrammarMatcher(compiled)
        viable = m.accept_string(text)
        assert viable == rec.is_prefix(text), text
        complete = viable and m.can_terminate()
        assert complete == rec.accepts(text), text
        if viable:
            assert _completion_found(compiled, rec, text), text
        elif len(text) <= 3 or any(t.startswith(text[:-1]) for t in texts):
            assert _no_completion(rec, text, alphabet), text


@pytest.mark.parametrize("name", sorted(CASES))
def test_masks_exact_bytes(name: str) -> None:
    _, _, texts = CASES[name]
    compiled = GrammarCompiler(tokenizer_info("bytes")).compile(_grammar(name))
    for text in texts:
        m = GrammarMatcher(compiled)
        for pos, b in enumerate(text.encode()):
            assert_mask_exact(m, pos)
            if not m.accept_token(b):
                break
        else:
            assert_mask_exact(m, len(text))


@pytest.mark.parametrize("name", ["one_of_objects", "nested", "recursive"])
def test_masks_exact_deepseek(name: str) -> None:
    _, _, texts = CASES[name]
    compiled = GrammarCompiler(tokenizer_info("deepseek")).compile(_grammar(name))
    tok = hf_tokenizer("deepseek")
    rec = ReferenceRecognizer(_grammar(name))
    for text in texts[:3]:
        m = GrammarMatcher(compiled)
        ids = tok.encode(text, add_special_tokens=False).ids
        for pos, tid in enumerate(ids):
            assert_mask_exact(m, pos)
            if not m.accept_token(tid):
                assert not rec.accepts(text)
                break
        else:
            assert_mask_exact(m, len(ids))
            assert m.can_terminate() == rec.accepts(text)


@pytest.mark.parametrize("name", sorted(CASES))
def test_shortest_completion_passes_the_checks(name: str) -> None:
    _, _, texts = CASES[name]
    g = _grammar(name)
    rec = ReferenceRecognizer(g)
    compiled = GrammarCompiler(tokenizer_info("bytes")).compile(g)
    for text in texts:
        for cut in range(len(text) + 1):
            m = GrammarMatcher(compiled)
            if not m.accept_string(text[:cut]):
                continue
            done = m.shortest_completion()
            assert done is not None
            assert rec.accepts(text[:cut] + done.decode()), (text[:cut], done)


def test_rollback_and_fork_keep_verdicts() -> None:
    compiled = GrammarCompiler(tokenizer_info("bytes")).compile(_grammar("one_of_numbers"))
    m = GrammarMatcher(compiled)
    assert m.accept_string("[1")
    f = m.fork()
    assert not m.accept_string("]")  # 1 is in both branches
    assert m.accept_string(".5]") and m.can_terminate()
    m.rollback(1)
    assert not m.can_terminate() and not m.accept_string("]")
    assert m.accept_string(".25]") and m.can_terminate()
    assert f.accept_string(".5]") and f.can_terminate()
    m.reset()
    assert m.accept_string("[2.5]") and m.can_terminate()


def test_malformed_checks_are_definition_errors() -> None:
    with pytest.raises(GrammarDefinitionError, match="carriers"):
        Check((Ref("a"),), 2, (1,))
    with pytest.raises(GrammarDefinitionError, match="sorted"):
        Check((Ref("a"), Ref("b")), 2, (2, 1))
    with pytest.raises(GrammarDefinitionError, match="rule references"):
        Check((lit("a"),), 1, (1,))  # type: ignore[arg-type]
    with pytest.raises(GrammarDefinitionError, match="1 to 16"):
        Check(tuple(Ref(f"r{i}") for i in range(17)), 1, (1,))
    compiler = GrammarCompiler(tokenizer_info("bytes"))
    nested = Grammar.from_rules({"root": seq(lit("x"), Check((Ref("a"),), 1, (1,))), "a": DIGITS})
    with pytest.raises(GrammarDefinitionError, match="whole body"):
        compiler.compile(nested)
    at_root = Grammar.from_rules({"root": Check((Ref("a"),), 1, (1,)), "a": DIGITS})
    with pytest.raises(GrammarDefinitionError, match="root"):
        compiler.compile(at_root)
    empty = Grammar.from_rules({"root": Ref("c"), "c": Check((Ref("a"),), 1, (1,)), "a": opt(lit("x"))})
    with pytest.raises(GrammarDefinitionError, match="empty string"):
        compiler.compile(empty)
    looping = Grammar.from_rules(
        {
            "root": Ref("c"),
            "c": Check((Ref("a"), Ref("b")), 2, (1, 2)),
            "a": seq(Ref("c"), lit("x")),
            "b": DIGITS,
        }
    )
    with pytest.raises(GrammarDefinitionError, match="begins with itself"):
        compiler.compile(looping)


def test_check_work_is_bounded() -> None:
    # root ::= c+ over x*: each x ends a check at every earlier origin, and deciding each reads
    # the set's finishes, so a byte's work grows with the input until the budget stops it.
    rules = {
        "root": plus(Ref("c")),
        "c": Check((Ref("a"), Ref("b")), 2, (0b01, 0b10)),
        "a": plus(lit("x")),
        "b": seq(plus(lit("x")), lit("y")),
    }
    compiler = GrammarCompiler(tokenizer_info("bytes"), max_work_per_byte=2000)
    m = GrammarMatcher(compiler.compile(Grammar.from_rules(rules)))
    assert m.accept_string("x" * 10)
    with pytest.raises(GrammarLimitError, match="work budget"):
        for _ in range(200):
            m.accept_string("x")
    n = m.num_tokens if hasattr(m, "num_tokens") else None
    assert m.accept_string("y")  # the failed call left the matcher as it was
    del n


def _as_products(rules: dict[str, Expr]) -> dict[str, Expr]:
    return {
        name: Check(body.items, body.carriers, body.accept, True) if isinstance(body, Check) else body
        for name, body in rules.items()
    }


# Checks compiled to one automaton: the cases above without recursion, and one no run-time
# verdict could keep exact (A and B where B dies on a prefix A keeps: "[2" has no completion).
PRODUCTS: dict[str, tuple[dict[str, Expr], str, list[str]]] = {
    name: (_as_products(rules), alphabet, texts)
    for name, (rules, alphabet, texts) in CASES.items()
    if name != "recursive"
}
PRODUCTS["dead_prefixes"] = (
    {
        "root": _list(Ref("c")),
        "c": Check((Ref("a"), Ref("b")), 1, (0b11,), True),
        "a": seq(star(chars("0-9")), chars("02468")),
        "b": seq(lit("1"), star(chars("0-9"))),
    },
    "[0123,]",
    ["[12]", "[2]", "[13]", "[10,102]", "[1]"],
)


@pytest.mark.parametrize("name", sorted(PRODUCTS))
def test_products_agree_with_brute_force(name: str) -> None:
    rules, alphabet, texts = PRODUCTS[name]
    g = Grammar.from_rules(rules)
    assert parse_gbnf(str(g)) == g
    rec = ReferenceRecognizer(g)
    compiled = GrammarCompiler(tokenizer_info("bytes")).compile(g)
    for text in _candidates(texts, alphabet):
        m = GrammarMatcher(compiled)
        viable = m.accept_string(text)
        assert (viable and m.can_terminate()) == rec.accepts(text), text
        if viable:
            assert _completion_found(compiled, rec, text), text
        else:
            assert _no_completion(rec, text, alphabet), text
    m = GrammarMatcher(compiled)
    valid = next(t for t in texts if rec.accepts(t))
    for pos, b in enumerate(valid.encode()):
        assert_mask_exact(m, pos)
        assert m.accept_token(b)
    assert m.can_terminate()


def test_product_of_recursive_items_is_a_limit_error() -> None:
    rules = _as_products(CASES["recursive"][0])
    with pytest.raises(
        GrammarLimitError,
        match=r"rule .v. cannot be compiled to one automaton: an item contains the check itself",
    ):
        GrammarCompiler(tokenizer_info("bytes")).compile(Grammar.from_rules(rules))
