"""The float64 number policy: numbers the schema leaves open end within float64/int64 digits,
every double keeps a spelling, and what the schema states (bounds, multipleOf) stays exact."""

from __future__ import annotations

import random
import struct

import pytest

from agent_infer.errors import ConfigError
from agent_infer.grammar import CompiledGrammar, Grammar, GrammarCompiler, GrammarMatcher, TokenizerInfo
from agent_infer.structured import StructuredOutput


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TokenizerInfo.bytes_only(), cache_enabled=False)


def _compile(compiler: GrammarCompiler, schema: object, numbers: str = "float64") -> CompiledGrammar:
    return compiler.compile(Grammar.from_json_schema(schema, numbers=numbers, whitespace="compact"))


def _accepts(compiled: CompiledGrammar, text: str) -> bool:
    m = GrammarMatcher(compiled)
    return m.accept_string(text) and m.can_terminate()


def test_a_number_ends_after_float64_precision(compiler: GrammarCompiler) -> None:
    g = _compile(compiler, {"type": "number"})
    assert _accepts(g, "3.141592653589793")
    assert not _accepts(g, "3.14159265358979323846")
    assert _accepts(g, "12345678901234567") and not _accepts(g, "123456789012345678")
    assert _accepts(g, "1e-05") and _accepts(g, "-1.7976931348623157E+308") and _accepts(g, "5e-324")
    assert not _accepts(g, "1e1000")
    assert _accepts(g, "0.00000000000000001") and not _accepts(g, "0.000000000000000001")
    # The exact language (JSON Schema's) keeps every digit.
    assert _accepts(_compile(compiler, {"type": "number"}, "exact"), "3.14159265358979323846")


def test_every_double_keeps_its_shortest_spelling(compiler: GrammarCompiler) -> None:
    g = _compile(compiler, {"type": "number"})
    rng = random.Random(7)
    rejected = []
    for _ in range(3000):
        x = struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0]
        if x == x and abs(x) != float("inf") and not _accepts(g, repr(x)):
            rejected.append(repr(x))
    assert rejected == []


def test_integers_hold_64_bits(compiler: GrammarCompiler) -> None:
    g = _compile(compiler, {"type": "integer"})
    assert _accepts(g, "18446744073709551615") and _accepts(g, "-9223372036854775808")
    assert not _accepts(g, "111111111111111111111")
    non_negative = _compile(compiler, {"type": "integer", "minimum": 0})
    assert _accepts(non_negative, "99999999999999999999") and not _accepts(non_negative, "-1")
    assert not _accepts(non_negative, "100000000000000000000")


@pytest.mark.parametrize(
    ("schema", "valid"),
    [
        # Stated bounds past the policy's limits are the schema's word.
        ({"type": "integer", "minimum": 10**25}, [str(10**25), str(10**40)]),
        ({"type": "integer", "minimum": 0, "maximum": 10**30}, [str(10**29), "0"]),
        ({"type": "number", "minimum": 1e20}, ["100000000000000000000.5"]),
        ({"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 10}, ["2.5", "10", "0"]),
        ({"type": "number", "multipleOf": 3}, ["9", "9.0", "-3"]),
        ({"type": "number", "multipleOf": 0.01}, ["3.14", "-0.5"]),
        ({"type": "integer", "multipleOf": 7}, ["7" * 30 + "0"]),
    ],
)
def test_stated_constraints_stay_exact(compiler: GrammarCompiler, schema: dict, valid: list[str]) -> None:
    g = _compile(compiler, schema)
    assert all(_accepts(g, v) for v in valid)


def test_bounded_fractions_end(compiler: GrammarCompiler) -> None:
    g = _compile(compiler, {"type": "number", "minimum": 0, "maximum": 1})
    assert _accepts(g, "0.33333333333333333") and _accepts(g, "1")
    assert not _accepts(g, "0.333333333333333333333") and not _accepts(g, "1.5")
    fraction = _compile(compiler, {"type": "number", "not": {"type": "integer"}})
    assert _accepts(fraction, "1.5") and not _accepts(fraction, "2")
    assert not _accepts(fraction, "1." + "5" * 30)
    anything = _compile(compiler, {})
    assert _accepts(anything, '{"a":[1.5,3.1415]}')
    assert not _accepts(anything, '{"a":[3.14159265358979323846]}')


def test_requests_default_to_the_policy_and_can_opt_out() -> None:
    schema = {"type": "number"}
    long = "3.14159265358979323846"
    default = StructuredOutput.json_schema(schema).to_grammar()
    exact = StructuredOutput.json_schema(schema, numbers="exact").to_grammar()
    compiler = GrammarCompiler(TokenizerInfo.bytes_only(), cache_enabled=False)
    assert not _accepts(compiler.compile(default), long)
    assert _accepts(compiler.compile(exact), long)
    # The grammar compiler itself keeps JSON Schema's semantics unless asked.
    assert _accepts(compiler.compile(Grammar.from_json_schema(schema)), long)
    with pytest.raises(ConfigError, match="numbers"):
        StructuredOutput.json_schema(schema, numbers="double")
