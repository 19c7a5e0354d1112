"""Hypothesis strategies for the grammar fuzz suite: each draws one case for :mod:`fuzz_worker`.

Regexes come from a small ``re`` syntax tree (so every draw is a valid Python pattern), schemas from
a recursive mix of keywords, grammar texts from mutations of the shipped GBNF grammars, the shared
GBNF corpus and a few Lark grammars. Sizes stay small: a case must run in well under a second so the
default profile fits the test budget; the campaign script draws from the same strategies for longer.
Stress cases go past the limits on purpose: nesting, counted repeats, self-recursive rules, extreme
schema keyword values (huge, infinite, NaN, negative) and layout options.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from shared_data import SHARED_DATA

ROOT = Path(__file__).resolve().parents[2]
GBNF_DIRS = (ROOT / "grammars", SHARED_DATA / "gbnf")
TOKENIZERS = ("bytes", "smollm2", "deepseek")

# --- regexes ---------------------------------------------------------------------------------------

_LITERALS = "abc01-. é中\n"
_CLASSES = ["[abc]", "[a-c]", "[^ab]", "[0-9a-f]", "[-a]", "[é-ë]", ".", r"\d", r"\w", r"\s", r"\D", "[^\n]"]
_QUANTIFIERS = ["?", "*", "+", "{2}", "{0,2}", "{1,3}", "{2,}", "??", "*?", "+?", "{1,2}?"]


def _quantified(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.tuples(inner, st.sampled_from(_QUANTIFIERS)).map(lambda p: f"(?:{p[0]}){p[1]}")


_regex_atoms = st.one_of(st.sampled_from(_LITERALS).map(re.escape), st.sampled_from(_CLASSES))
regexes: st.SearchStrategy[str] = st.recursive(
    _regex_atoms,
    lambda inner: st.one_of(
        st.lists(inner, min_size=2, max_size=4).map("".join),
        st.lists(inner, min_size=2, max_size=3).map("|".join).map(lambda s: f"(?:{s})"),
        inner.map(lambda s: f"({s})"),
        _quantified(inner),
    ),
    max_leaves=8,
)


@st.composite
def regex_cases(draw: Any, tokenizers: tuple[str, ...] = ("bytes",)) -> dict[str, Any]:
    """A pattern with candidates: strings it matches (Hypothesis' own generator) and near misses."""
    pattern = draw(regexes)
    matching = draw(st.lists(st.from_regex(pattern, fullmatch=True), max_size=3))
    others = draw(st.lists(st.text(alphabet=_LITERALS + "xyz!", max_size=8), max_size=3))
    return {
        "kind": "regex",
        "pattern": pattern,
        "matching": matching,
        "candidates": others,
        "tokenizer": draw(st.sampled_from(tokenizers)),
        "seed": draw(st.integers(0, 2**31)),
    }


# --- JSON Schemas ----------------------------------------------------------------------------------

_NAMES = ["a", "b", "id", "name", "x y", "é"]
_SCALAR_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-20, 20),
    st.sampled_from([0.5, -1.25, 3.75, 1e-3]),
    st.text(alphabet="abé 1", max_size=4),
)
# Empty containers are leaves: Hypothesis checks that `extend` uses its argument by extending
# nothing(), so every extended branch needs at least one inner draw.
json_values: st.SearchStrategy[Any] = st.recursive(
    _SCALAR_VALUES | st.just([]) | st.just({}),
    lambda inner: st.one_of(
        st.lists(inner, min_size=1, max_size=3),
        st.dictionaries(st.sampled_from(_NAMES), inner, min_size=1, max_size=3),
    ),
    max_leaves=6,
)


def _with(
    base: dict[str, Any], extra: st.SearchStrategy[dict[str, Any]]
) -> st.SearchStrategy[dict[str, Any]]:
    return extra.map(lambda e: {**base, **e})


def _keywords(**options: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    """Any subset of the given keywords, each with a drawn value."""
    return st.fixed_dictionaries({}, optional=options)


_small = st.integers(0, 4)
_bound = st.one_of(st.integers(-10, 10), st.sampled_from([0.5, -2.5]))
_leaf_schemas = st.one_of(
    _with(
        {"type": "string"},
        _keywords(
            minLength=_small, maxLength=_small, pattern=st.sampled_from(["^a", "b$", "[0-9]", "^[a-c]*$"])
        ),
    ),
    _with(
        {"type": "integer"},
        _keywords(minimum=_bound, maximum=_bound, exclusiveMinimum=_bound, multipleOf=st.integers(1, 5)),
    ),
    _with({"type": "number"}, _keywords(minimum=_bound, exclusiveMaximum=_bound)),
    st.sampled_from([{"type": "boolean"}, {"type": "null"}, {}, True, {"type": ["integer", "string"]}]),
    st.lists(_SCALAR_VALUES, min_size=1, max_size=3, unique_by=repr).map(lambda v: {"enum": v}),
    _SCALAR_VALUES.map(lambda v: {"const": v}),
    # Containers without subschemas (the compound ones below always have one).
    _with({"type": "array"}, _keywords(minItems=_small, maxItems=_small, uniqueItems=st.booleans())),
    _with(
        {"type": "object"},
        _keywords(minProperties=_small, maxProperties=_small, additionalProperties=st.booleans()),
    ),
)


def _compound(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    props = st.dictionaries(st.sampled_from(_NAMES), inner, min_size=1, max_size=3)
    obj = st.builds(
        lambda p, req, extra: {
            "type": "object",
            "properties": p,
            "required": [n for n in req if n in p],
            **extra,
        },
        props,
        st.lists(st.sampled_from(_NAMES), max_size=2, unique=True),
        _keywords(
            additionalProperties=st.one_of(st.booleans(), inner),
            minProperties=_small,
            maxProperties=_small,
        ),
    )
    arr = inner.flatmap(
        lambda item: _with(
            {"type": "array", "items": item},
            _keywords(minItems=_small, maxItems=_small, uniqueItems=st.booleans()),
        )
    )
    logic = st.one_of(
        st.lists(inner, min_size=1, max_size=3).map(lambda s: {"anyOf": s}),
        st.lists(inner, min_size=1, max_size=2).map(lambda s: {"allOf": s}),
        st.lists(inner, min_size=1, max_size=2).map(lambda s: {"oneOf": s}),
        inner.map(lambda s: {"not": s}),
    )
    # Few `not`s: most complements are unsupported (a typed error ends the case early).
    return st.one_of(obj, obj, arr, arr, logic)


schemas: st.SearchStrategy[Any] = st.recursive(_leaf_schemas, _compound, max_leaves=5)


@st.composite
def schema_cases(draw: Any, tokenizers: tuple[str, ...] = ("bytes",)) -> dict[str, Any]:
    """A schema with instances to validate (random JSON values; the worker adds generated ones)."""
    return {
        "kind": "schema",
        "schema": draw(schemas),
        "instances": draw(st.lists(json_values, max_size=4)),
        "tokenizer": draw(st.sampled_from(tokenizers)),
        "seed": draw(st.integers(0, 2**31)),
    }


# --- grammar texts ---------------------------------------------------------------------------------

LARK_SEEDS = (
    'start: pair ("," pair)*\npair: KEY ":" VALUE\nKEY: /[a-z]+/\nVALUE: INT | "true" | "false"\n%import common.INT\n',
    'start: expr\n?expr: term (("+"|"-") term)*\n?term: NUMBER | "(" expr ")"\nNUMBER: /[0-9]+/\n',
    'start: "[" [item ("," item)*] "]"\nitem: ESCAPED_STRING | SIGNED_NUMBER\n'
    "%import common.ESCAPED_STRING\n%import common.SIGNED_NUMBER\n",
    'start: greeting+\ngreeting: HELLO NAME\nHELLO: "hi " | "hello "\nNAME: /[A-Z][a-z]{0,5}/ " "?\n',
)

# Pieces of grammar syntax: mutations built from them reach deeper than random characters.
_GRAMMAR_TOKENS = [
    "::=",
    "|",
    "(",
    ")",
    "*",
    "+",
    "?",
    "{2,3}",
    "{0,}",
    "{,4}",
    "{99999}",
    '"',
    '""',
    "[",
    "]",
    "[^",
    "\\",
    "-",
    "root",
    "x",
    " ",
    "\n",
    "#",
    ".",
    "ws",
    "/[a-z]+/",
    "->",
    ":",
    "%import common.WS",
    "%ignore WS",
    "?",
    "~",
    "\\u00e9",
    "\\x00",
    "\x00",
    "é",
    "\ud800",
    "((((",
    "))))",
    "root ::= root",
    "start:",
]


def _grammar_seeds() -> list[tuple[str, str]]:
    seeds = [
        ("gbnf", p.read_text(encoding="utf-8"))
        for d in GBNF_DIRS
        if d.is_dir()
        for p in sorted(d.glob("*.gbnf"))
    ]
    seeds += [("lark", p.read_text(encoding="utf-8")) for p in sorted((ROOT / "grammars").glob("*.lark"))]
    return seeds + [("lark", text) for text in LARK_SEEDS]


GRAMMAR_SEEDS = _grammar_seeds()


@st.composite
def mutated_text(draw: Any, text: str) -> str:
    """``text`` with 1-4 edits: a slice deleted, a syntax piece or random character inserted, a
    slice duplicated or moved."""
    for _ in range(draw(st.integers(1, 4))):
        n = len(text)
        i = draw(st.integers(0, n))
        j = draw(st.integers(i, min(n, i + 40)))
        op = draw(st.integers(0, 3))
        if op == 0:
            text = text[:i] + text[j:]
        elif op == 1:
            piece = draw(
                st.one_of(st.sampled_from(_GRAMMAR_TOKENS), st.characters(max_codepoint=0x2FF).map(str))
            )
            text = text[:i] + piece + text[i:]
        elif op == 2:
            text = text[:j] + text[i:j] + text[j:]
        else:
            k = draw(st.integers(0, n))
            chunk, rest = text[i:j], text[:i] + text[j:]
            k = min(k, len(rest))
            text = rest[:k] + chunk + rest[k:]
    return text


@st.composite
def grammar_cases(draw: Any, tokenizers: tuple[str, ...] = ("bytes",)) -> dict[str, Any]:
    """A shipped or corpus grammar, mutated (or, now and then, as is)."""
    syntax, text = draw(st.sampled_from(GRAMMAR_SEEDS))
    if draw(st.integers(0, 9)):
        text = draw(mutated_text(text))
    return {
        "kind": "grammar",
        "syntax": syntax,
        "text": text,
        "tokenizer": draw(st.sampled_from(tokenizers)),
        "seed": draw(st.integers(0, 2**31)),
    }


CASE_STRATEGIES = {"regex": regex_cases, "schema": schema_cases, "grammar": grammar_cases}


# --- stress: sizes and values past the limits ------------------------------------------------------

_BIG = [1, 10, 100, 1000, 5000, 100_000]
# Nested counts multiply: the worker generates a member of the language, so keep it at most ~1 MB.
_BIG_PAIRS = st.tuples(st.sampled_from(_BIG), st.sampled_from(_BIG)).filter(lambda p: p[0] * p[1] <= 10**6)
_HOSTILE_NUMBERS = [
    10**30,
    -(10**30),
    float("inf"),
    float("-inf"),
    float("nan"),
    1e308,
    -0.0,
    2**63,
    2**31,
    0.1,
    -1,
]


def _nested(depth: int, open_: str, leaf: str, close: str) -> str:
    return open_ * depth + leaf + close * depth


_stress_regex = st.one_of(
    st.integers(1, 600).map(lambda d: _nested(d, "(", "a", ")")),
    st.integers(1, 600).map(lambda d: _nested(d, "(?:", "a|b", ")*")),
    _BIG_PAIRS.map(lambda p: f"(a{{{p[0]}}}){{{p[1]}}}"),
    st.tuples(st.sampled_from(_BIG), st.sampled_from(_BIG)).map(lambda p: f"[a-z]{{{p[0]},{p[0] + p[1]}}}b"),
    st.lists(st.text(alphabet="abcxyz", min_size=1, max_size=6), min_size=1, max_size=400).map("|".join),
)
_stress_gbnf = st.one_of(
    st.integers(1, 1200).map(lambda d: "root ::= " + _nested(d, "(", '"a"', ")")),
    st.sampled_from(
        [
            'root ::= root root | "a"',
            'root ::= "a" root | ""',
            'root ::= root "a" | "a"',
            "root ::= x\nx ::= root",
            'root ::= (root | "a")*',
            'root ::= ("" | "a")*',
        ]
    ),
    _BIG_PAIRS.map(lambda p: f'root ::= ("ab"{{{p[0]}}}){{{p[1]}}}'),
)
_stress_lark = st.one_of(
    st.integers(1, 600).map(lambda d: "start: " + _nested(d, "(", '"a"', ")")),
    st.sampled_from(_BIG).map(lambda n: f'start: "a"~{n}'),
    st.just('start: start start | "a"'),
)


def _deep_schema(depth: int, keyword: str) -> dict[str, Any]:
    """``depth`` nested arrays or objects; at most 250 keeps the case within json.dumps' recursion
    limit (3 JSON levels per object level) on its way to the worker."""
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = (
            {"type": "array", "items": schema}
            if keyword == "items"
            else {"type": "object", "properties": {"a": schema}}
        )
    return schema


_hostile = st.sampled_from(_HOSTILE_NUMBERS)
_stress_schema = st.one_of(
    st.tuples(st.integers(1, 250), st.sampled_from(["items", "properties"])).map(lambda p: _deep_schema(*p)),
    _with(
        {"type": "integer"},
        _keywords(minimum=_hostile, maximum=_hostile, exclusiveMaximum=_hostile, multipleOf=_hostile),
    ),
    _with({"type": "number"}, _keywords(minimum=_hostile, exclusiveMinimum=_hostile, multipleOf=_hostile)),
    _with({"type": "string"}, _keywords(minLength=_hostile, maxLength=_hostile)),
    _with({"type": "array"}, _keywords(minItems=_hostile, maxItems=_hostile)),
    _with({"type": "object"}, _keywords(minProperties=_hostile, maxProperties=_hostile)),
    _hostile.map(lambda v: {"enum": [v]}),
)
_schema_options = _keywords(
    whitespace=st.sampled_from(["compact", "flexible"]),
    max_whitespace=st.sampled_from([0, 2, 10**6, -1]),
    indent=st.sampled_from([None, 0, 2, 10**6, -1]),
)


@st.composite
def stress_cases(draw: Any, tokenizers: tuple[str, ...] = ("bytes",)) -> dict[str, Any]:
    """Deep nesting, huge repeat counts, self-recursive rules, extreme keyword values and layout
    options: each must compile within the limits or raise a typed error."""
    front = draw(st.sampled_from(["regex", "gbnf", "lark", "schema"]))
    source = {"regex": _stress_regex, "gbnf": _stress_gbnf, "lark": _stress_lark, "schema": _stress_schema}[
        front
    ]
    return {
        "kind": "stress",
        "front": front,
        "source": draw(source),
        "options": draw(_schema_options) if front == "schema" else {},
        "tokenizer": draw(st.sampled_from(tokenizers)),
        "seed": draw(st.integers(0, 2**31)),
    }


CASE_STRATEGIES["stress"] = stress_cases
