"""Seeded random ``oneOf``/``not``/``allOf`` schemas against jsonschema, where they compile to checks.

Each schema mixes the keywords the check alignment rewrites (declared and pattern properties,
property names, dependencies, numbers of every grammar, constrained and free strings, exact formats, listed values, nested
logic). Every compiled one must accept no invalid instance in any spelling (escaped ASCII in
strings and keys, ``1.0``/``1e0``/``-0`` numbers), and where it holds a check, every prefix of an
instance the matcher keeps must complete to a valid one (duplicate keys aside: outside the
contract). The generator is plain ``random`` with fixed seeds, so a failure reproduces.
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest

from agent_infer.errors import AgentInferError
from agent_infer.grammar import Grammar, GrammarCompiler, GrammarMatcher, TokenizerInfo
from agent_infer.grammar.ir import Check

FORMATS = jsonschema.FormatChecker()
NAMES = ["a", "b", "ab", "x1", "n"]
PATTERNS = ["^a", "b$", "^x", "1", "^n"]
SCHEMAS_PER_SEED = 120
INSTANCES = 160
PREFIX_INSTANCES = 25


class _Gen:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def number(self) -> dict[str, Any]:
        r = self.rng
        s: dict[str, Any] = {}
        if r.random() < 0.6:
            s["type"] = r.choice(["integer", "number"])
        for key, options in (
            ("minimum", [0, 1, -2, 2.5]),
            ("maximum", [3, 10, 0]),
            ("multipleOf", [2, 3, 0.5]),
            ("exclusiveMinimum", [0, 1]),
        ):
            if r.random() < 0.25:
                s[key] = r.choice(options)
        return s

    def string(self) -> dict[str, Any]:
        r = self.rng
        s: dict[str, Any] = {"type": "string"}
        x = r.random()
        if x < 0.3:
            s["pattern"] = r.choice(["^x", "y", "^.$", "^[a-c]+$"])
        elif x < 0.4:
            s["format"] = r.choice(["uuid", "ipv4", "x-unknown"])
        if r.random() < 0.3:
            s["maxLength"] = r.choice([1, 2, 3])
        return s

    def leaf(self, d: int) -> Any:
        r = self.rng
        x = r.random()
        if d < 2 and x < 0.08:
            kind = r.choice(["oneOf", "anyOf", "not"])
            if kind == "not":
                return {"not": self.leaf(d + 1)}
            return {kind: [self.leaf(d + 1) for _ in range(r.randint(2, 3))]}
        if x < 0.1:
            return {"const": r.choice([1, "x", None, [1], {"a": 1}, 2.5, 0])}
        x = r.random()
        if x < 0.3:
            return self.number()
        if x < 0.5:
            return self.string()
        if x < 0.6:
            return r.choice([True, {}, {"type": "null"}, {"type": "boolean"}])
        if x < 0.7:
            return {"enum": r.sample([1, 2, "x", "y", None, 2.5, [1], {"a": 1}], r.randint(1, 3))}
        if x < 0.85 and d < 2:
            return self.obj(d + 1)
        return self.arr(d + 1) if d < 2 else self.number()

    def obj(self, d: int) -> dict[str, Any]:
        r = self.rng
        s: dict[str, Any] = {"type": "object"} if r.random() < 0.7 else {}
        if r.random() < 0.7:
            s["properties"] = {n: self.leaf(d) for n in r.sample(NAMES, r.randint(1, 3))}
        if r.random() < 0.3:
            s["patternProperties"] = {p: self.leaf(d) for p in r.sample(PATTERNS, r.randint(1, 2))}
        if r.random() < 0.4:
            s["required"] = r.sample(NAMES, r.randint(1, 2))
        if r.random() < 0.4:
            s["additionalProperties"] = r.choice([False, True, self.leaf(d)])
        if r.random() < 0.15:
            s["maxProperties"] = r.choice([1, 2])
        if r.random() < 0.1:
            s["minProperties"] = r.choice([1, 2])
        if r.random() < 0.1:
            s["propertyNames"] = r.choice(
                [{"maxLength": 1}, {"pattern": "^[a-n]"}, {"enum": ["a", "b", "x1"]}]
            )
        if r.random() < 0.1:
            s["dependentRequired"] = r.choice([{"a": ["b"]}, {"x1": ["n", "ab"]}])
        return s

    def arr(self, d: int) -> dict[str, Any]:
        r = self.rng
        s: dict[str, Any] = {"type": "array"}
        if r.random() < 0.6:
            s["items"] = self.leaf(d)
        if r.random() < 0.3:
            s["prefixItems"] = [self.leaf(d) for _ in range(r.randint(1, 2))]
        if r.random() < 0.3:
            s["maxItems"] = r.choice([1, 2, 3])
        if r.random() < 0.15:
            s["contains"] = self.leaf(d)
        return s

    def schema(self) -> Any:
        r = self.rng
        x = r.random()
        if x < 0.5:
            return {"oneOf": [self.leaf(0) for _ in range(r.randint(2, 3))]}
        if x < 0.8:
            base = self.leaf(0) if r.random() < 0.5 else {}
            return {**(base if isinstance(base, dict) else {}), "not": self.leaf(0)}
        return {"allOf": [self.leaf(0) for _ in range(r.randint(2, 3))]}

    def instance(self, d: int = 0) -> Any:
        r = self.rng
        x = r.random()
        if x < 0.3:
            return r.choice([0, 1, 2, 3, -2, 2.5, 0.5, 4, 6, 10, 1.25, 12, -0.5])
        if x < 0.5:
            return r.choice(
                ["", "x", "xy", "y", "abc", "1.2.3.4", "123e4567-e89b-12d3-a456-426614174000", "b"]
            )
        if x < 0.6:
            return r.choice([None, True, False])
        if x < 0.8 and d < 3:
            return {n: self.instance(d + 1) for n in r.sample([*NAMES, "zz", "a1", "nb"], r.randint(0, 3))}
        if d < 3:
            return [self.instance(d + 1) for _ in range(r.randint(0, 3))]
        return 1

    def respelled(self, text: str) -> str:
        """``text`` with some string characters escaped and some numbers spelled another way."""
        r = self.rng
        out: list[str] = []
        i, in_string = 0, False
        while i < len(text):
            ch = text[i]
            if in_string:
                if ch == "\\":
                    out.append(text[i : i + 2])
                    i += 2
                    continue
                in_string = ch != '"'
                out.append(f"\\u{ord(ch):04x}" if in_string and r.random() < 0.3 else ch)
                i += 1
                continue
            if ch == '"':
                in_string = True
            number = re.match(r"-?\d+(\.\d+)?([eE][-+]?\d+)?", text[i:])
            if number and (i == 0 or text[i - 1] in ",:["):
                spelled = number.group(0)
                x = r.random()
                if x < 0.25 and not re.search(r"[.eE]", spelled):
                    spelled += ".0"
                elif x < 0.4:
                    spelled += "e0"
                elif x < 0.5 and spelled == "0":
                    spelled = "-0"
                out.append(spelled)
                i += len(number.group(0))
                continue
            out.append(ch)
            i += 1
        return "".join(out)


def _accepts(compiled: Any, text: str) -> bool:
    m = GrammarMatcher(compiled)
    return m.accept_string(text) and m.can_terminate()


def _unique_keys(text: str) -> bool:
    seen: list[bool] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        seen.append(len({k for k, _ in items}) == len(items))
        return dict(items)

    json.loads(text, object_pairs_hook=pairs)
    return all(seen)


@pytest.mark.parametrize("seed", [1, 7, 20])
def test_random_logic_schemas_accept_no_invalid_instance(seed: int) -> None:
    gen = _Gen(seed)
    compiler = GrammarCompiler(TokenizerInfo.bytes_only(), cache_enabled=False)
    instances = [json.dumps(gen.instance(), separators=(",", ":")) for _ in range(INSTANCES)]
    checked = 0
    for _ in range(SCHEMAS_PER_SEED):
        schema = gen.schema()
        try:
            grammar = Grammar.from_json_schema(schema, whitespace="compact")
            compiled = compiler.compile(grammar)
        except AgentInferError:
            continue
        oracle = jsonschema.Draft202012Validator(schema, format_checker=FORMATS)
        for text in instances:
            for spelled in (text, gen.respelled(text)):
                if _accepts(compiled, spelled):
                    assert oracle.is_valid(json.loads(spelled)), (schema, spelled)
        if not any(isinstance(body, Check) for _, body in grammar.rules):
            continue
        checked += 1
        for text in instances[:PREFIX_INSTANCES]:
            for cut in range(len(text) + 1):
                m = GrammarMatcher(compiled)
                if not m.accept_string(text[:cut]):
                    break
                rest = m.shortest_completion()
                assert rest is not None, (schema, text[:cut])
                whole = text[:cut] + rest.decode()
                if _unique_keys(whole):
                    assert oracle.is_valid(json.loads(whole)), (schema, whole)
    assert checked >= 5, "too few schemas compiled to checks to test them"
