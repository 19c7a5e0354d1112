"""Limits of grammar construction: nesting depth of the text front ends, memory while building
automata, and the size of strings the test-string generator draws."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest
from hypothesis import HealthCheck, given, settings

from agent_infer.errors import GrammarLimitError
from agent_infer.grammar import Grammar, GrammarCompiler, GrammarMatcher, TokenizerInfo
from agent_infer.grammar.frontends.ebnf.gbnf import MAX_GROUP_NESTING as GBNF_NESTING
from agent_infer.grammar.frontends.ebnf.lark_parser import MAX_GROUP_NESTING as LARK_NESTING
from agent_infer.grammar.frontends.regex.parser import MAX_GROUP_NESTING as REGEX_NESTING
from agent_infer.grammar.frontends.regex.parser import MAX_SEARCH_SPAN
from agent_infer.grammar.frontends.regex.search import regex_search_expr
from agent_infer.grammar.ir import Alt, Literal, Seq
from agent_infer.testing import DEFAULT_MAX_LENGTH, random_strings, strings

BUILTINS = ["json", "json_array", "arithmetic", "sql_select", "tool_call", "csv", "yaml_subset"]


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TokenizerInfo.bytes_only())


def _deep_stack(depth: int, fn: object) -> object:
    """``fn()`` called ``depth`` frames below here: a caller that is itself deep in the stack."""
    if depth == 0:
        return fn()  # type: ignore[operator]
    return _deep_stack(depth - 1, fn)


def _accepts(compiler: GrammarCompiler, grammar: Grammar, text: str) -> bool:
    matcher = GrammarMatcher(compiler.compile(grammar))
    return matcher.accept_string(text) and bool(matcher.can_terminate())


# --- memory and work while building automata ----------------------------------------------------


def _run_capped(body: str, extra_mib: int, timeout: float = 120.0) -> tuple[str, float]:
    """Run ``body`` in a fresh interpreter whose address space may grow ``extra_mib`` MiB past what
    it has mapped once agent_infer is imported; returns its output and its wall time."""
    head = textwrap.dedent(
        f"""\
        import resource, time
        from agent_infer.grammar import Grammar, GrammarCompiler, GrammarMatcher, TokenizerInfo
        compiler = GrammarCompiler(TokenizerInfo.bytes_only())
        compiler.compile(Grammar.from_regex("[a-z]{{3}}"))  # the extension's own buffers first
        mapped = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
        resource.setrlimit(resource.RLIMIT_AS, (mapped + ({extra_mib} << 20),) * 2)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        try:
        """
    )
    tail = textwrap.dedent(
        """\
        except Exception as exc:
            print("raised", type(exc).__name__, exc)
        print("peak_kib", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
        """
    )
    script = head + textwrap.indent(textwrap.dedent(body).strip() + "\n", "    ") + tail
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, check=False
    )
    return done.stdout + done.stderr, time.perf_counter() - start


def test_long_literal_pattern_compiles_in_bounded_memory() -> None:
    # Determinizing `.*a{n}.*` holds sets of up to n pattern positions, one per state.
    out, _ = _run_capped(
        """
        n = 10_000
        g = Grammar.from_json_schema({"type": "string", "pattern": "a" * n})
        compiled = compiler.compile(g)
        def accepts(text):
            m = GrammarMatcher(compiled)
            return m.accept_string(text) and m.can_terminate()
        print("inside", accepts('"b' + "a" * n + 'c"'))
        print("short", accepts('"' + "a" * (n - 1) + 'b"'))
        """,
        extra_mib=1024,
    )
    assert "inside True" in out and "short False" in out, out
    peak_mib = int(out.split("peak_kib")[1].split()[0]) / 1024
    assert peak_mib < 200, out


def test_nested_repeat_pattern_is_a_quick_limit_error_in_bounded_memory() -> None:
    out, seconds = _run_capped(
        """
        schema = {"type": "object", "properties": {"p": {"type": "string", "pattern": "(a{1000}){1000}"}}}
        compiler.compile(Grammar.from_json_schema(schema))
        """,
        extra_mib=512,
    )
    assert "raised GrammarLimitError" in out, out
    assert f"more than {MAX_SEARCH_SPAN} character positions" in out and "(position 9)" in out, out
    assert "(at /properties/p/pattern)" in out, out
    assert seconds < 20, out


def test_search_span_limit_counts_what_follows_the_padding() -> None:
    regex_search_expr("a" * MAX_SEARCH_SPAN)
    with pytest.raises(GrammarLimitError, match=r"\(position 0\)"):
        regex_search_expr("a" * (MAX_SEARCH_SPAN + 1))
    with pytest.raises(GrammarLimitError, match=r"\(position 4\)"):
        regex_search_expr(f"x|(y{{{MAX_SEARCH_SPAN + 1}}})")
    # Anchored at the start, the run is matched from the first character: one set per position.
    regex_search_expr(f"^a{{{2 * MAX_SEARCH_SPAN}}}")
    regex_search_expr(f"^.{{1,{5 * MAX_SEARCH_SPAN}}}$")
    regex_search_expr(f".{{1,{5 * MAX_SEARCH_SPAN}}}$")  # the search only needs its last character


def test_large_state_sets_keep_the_exact_language(compiler: GrammarCompiler) -> None:
    # Overlapping prefixes put hundreds of positions in one subset (far past the flat sets).
    literal = "ab" * 150 + "c"
    grammar = Grammar.from_json_schema({"type": "string", "pattern": literal})
    texts = [
        "ab" * 150 + "c",
        "ab" * 400 + "c",
        "a" + "ab" * 150 + "cx",
        "ab" * 149 + "c",
        "ab" * 150 + "ac",
        "x" + "ab" * 75 + "b" + "ab" * 75 + "c",
        "ab" * 160,
    ]
    for text in texts:
        assert _accepts(compiler, grammar, json.dumps(text)) == (re.search(literal, text) is not None), text


def test_determinizing_stops_at_its_state_set_budget() -> None:
    # `.*a[ab]{n}` needs a state per combination of the last n characters, each holding about
    # n / 2 positions: with a state budget this large, the sets' memory is what must stop it.
    out, seconds = _run_capped(
        """
        big = GrammarCompiler(TokenizerInfo.bytes_only(), max_states=2_000_000)
        big.compile(Grammar.from_regex(".*a[ab]{2000}"))
        """,
        extra_mib=1536,
    )
    assert "raised GrammarLimitError" in out and "MiB of state sets" in out, out
    assert int(out.split("peak_kib")[1].split()[0]) < 1024 * 1024, out
    assert seconds < 60, out


@pytest.mark.skipif(
    "libasan" in os.environ.get("LD_PRELOAD", ""),
    reason="AddressSanitizer reports an allocation past an address-space limit itself (make test-asan)",
)
def test_running_out_of_memory_while_compiling_is_a_limit_error() -> None:
    out, _ = _run_capped(
        """
        compiler.compile(Grammar.from_regex("([a-z]{3}[0-9]){20000}"))
        print("compiled")
        """,
        extra_mib=8,
    )
    assert "raised GrammarLimitError grammar is too large: compiling it ran out of memory" in out, out


# --- nesting -------------------------------------------------------------------------------------


def _regex(depth: int) -> str:
    return "(a|" * depth + "b" + ")*" * depth


def _gbnf(depth: int) -> str:
    return "root ::= " + '("a" | ' * depth + '"b"' + ")*" * depth


def _lark(depth: int) -> str:
    # '[' and '(' alternate: both count as one level.
    opens = "".join('("a" | ' if k % 2 == 0 else '["a" ' for k in range(depth))
    closes = "".join(")*" if k % 2 == 0 else "]" for k in reversed(range(depth)))
    return '%ignore " "\nstart: ' + opens + '"b"' + closes


CASES = {
    "regex": (REGEX_NESTING, lambda d: Grammar.from_regex(_regex(d))),
    "gbnf": (GBNF_NESTING, lambda d: Grammar.from_ebnf(_gbnf(d))),
    "lark": (LARK_NESTING, lambda d: Grammar.from_ebnf(_lark(d), syntax="lark")),
    "schema pattern": (
        REGEX_NESTING,
        lambda d: Grammar.from_json_schema({"type": "string", "pattern": "^" + _regex(d) + "$"}),
    ),
}


@pytest.mark.parametrize("kind", CASES)
def test_nesting_at_the_limit_builds_prints_and_compiles(kind: str, compiler: GrammarCompiler) -> None:
    limit, build = CASES[kind]
    grammar = _deep_stack(100, lambda: build(limit))
    assert isinstance(grammar, Grammar)
    text = _deep_stack(100, lambda: str(grammar))
    assert isinstance(text, str) and text
    sample = "a" * (limit // 2) + "b"
    if kind == "schema pattern":
        sample = json.dumps(sample)
    assert _accepts(compiler, grammar, sample)


@pytest.mark.parametrize("kind", CASES)
@pytest.mark.parametrize("depth", [1, 2, 1000])
def test_nesting_beyond_the_limit_is_a_limit_error_naming_the_place(kind: str, depth: int) -> None:
    limit, build = CASES[kind]
    with pytest.raises(GrammarLimitError, match=f"deeper than {limit}") as err:
        build(limit + depth)
    # The innermost group that crosses the limit: the (limit + 1)-th opening bracket.
    if kind in ("regex", "schema pattern"):
        assert f"(position {3 * limit + (1 if kind == 'schema pattern' else 0)})" in str(err.value)
    elif kind == "gbnf":
        assert f"(line 1, column {len('root ::= ') + 7 * limit + 1})" in str(err.value)
    else:
        assert "(line 2, column" in str(err.value)


def test_deep_ir_prints() -> None:
    expr = Literal("b")
    for _ in range(3000):
        expr = Alt((Literal("a"), Seq((expr, Literal("c")))))
    text = str(Grammar.from_expr(expr))
    assert text.count("(") == text.count(")") == 3000 - 1
    assert text.count('"c"') == 3000
    shallow = Alt((Literal("a"), Seq((Alt((Literal("a"), Seq((Literal("b"), Literal("c"))))), Literal("c")))))
    assert str(Grammar.from_expr(shallow)) == 'root ::= "a" | ("a" | "b" "c") "c"\n'


# --- the test-string generator -------------------------------------------------------------------


@pytest.mark.parametrize("name", BUILTINS)
def test_twenty_draws_of_each_builtin_are_quick_bounded_and_accepted(
    name: str, compiler: GrammarCompiler
) -> None:
    grammar = Grammar.builtin(name)
    drawn: list[str] = []

    @settings(max_examples=20, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(text=strings(grammar))
    def draw(text: str) -> None:
        drawn.append(text)

    start = time.perf_counter()
    draw()
    assert time.perf_counter() - start < 5.0
    assert len(drawn) >= 20
    # Only the simplest completion follows the bound: a few hundred characters at most here.
    assert max(map(len, drawn)) < 2 * DEFAULT_MAX_LENGTH
    for text in drawn[:20]:
        assert _accepts(compiler, grammar, text), text


def test_max_length_is_configurable_and_keeps_short_strings(compiler: GrammarCompiler) -> None:
    grammar = Grammar.builtin("sql_select")
    short = random_strings(grammar, 30, seed=5, max_length=40)
    assert max(map(len, short)) < 200
    assert all(_accepts(compiler, grammar, t) for t in short)
    # Strings the bound never reaches are drawn exactly as without it.
    tiny = random_strings('root ::= [a-z]{1,5} ("," [a-z]{1,5})*', 50, seed=2, max_length=10_000)
    assert tiny == random_strings('root ::= [a-z]{1,5} ("," [a-z]{1,5})*', 50, seed=2)
    long = random_strings(grammar, 5, seed=5, max_length=5000)
    assert max(map(len, long)) > max(map(len, short))
