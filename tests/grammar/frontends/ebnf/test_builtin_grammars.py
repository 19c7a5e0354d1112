"""Built-in grammars in grammars/: each loads, and accepts/rejects hand-written examples."""

from __future__ import annotations

import pytest

from agent_infer.grammar.ir import Grammar, grammars_dir
from agent_infer.testing import (
    assert_accepts,
    assert_prefix,
    assert_rejects,
    random_strings,
)

EXAMPLES: dict[str, tuple[list[str], list[str]]] = {
    "json": (
        ['{"a": 1, "b": [true, false, null], "c": {"d": "e\\u00e9\\n"}}', " [ ] ", "-0.5e+3", '"x"'],
        ['{"a": 1,}', "[01]", "{'a': 1}", '"tab\tinside"', "[1 2]", "NaN"],
    ),
    "json_array": (["[]", '[1, "two", {"three": [3]}]', " [null] "], ["{}", "1", "[1,]", "[[]"]),
    "arithmetic": (
        ["1+2*3", "-(4 - 2.5) ^ 2 % 7", " 10 / ( 3 +4 ) ", "2^-1"],
        ["1+", "()", "1 2", "1e5", "*3"],
    ),
    "sql_select": (
        [
            "SELECT * FROM users",
            "select id, name AS n from public.users u where age >= 18 and name like 'A%' order by n desc limit 10;",
            "SELECT u.id, COUNT(*) AS c FROM users AS u LEFT OUTER JOIN orders o ON o.user_id = u.id "
            "WHERE u.deleted_at IS NULL OR u.id IN (1, 2, 3) GROUP BY u.id HAVING COUNT(*) > 2 "
            "ORDER BY c DESC, u.id ASC LIMIT 5 OFFSET 10",
            "SELECT DISTINCT \"Full Name\" FROM t WHERE NOT x BETWEEN 1 AND 2 AND y <> 'it''s'",
        ],
        [
            "SELECT FROM users",
            "SELECT * users",
            "SELECT * FROM users u WHERE x =",
            "SELECT * FROM t LIMIT x",
            "SELECT * FROM t WHERE a = 'open",
            "Select * From t",
            "UPDATE t SET a = 1",
        ],
    ),
    "tool_call": (
        [
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>',
            '<tool_call>\n{"name": "a.b", "arguments": {}}\n</tool_call>\n<tool_call>{"name": "x", '
            '"arguments": {"q": [1, {"r": null}]}}</tool_call>',
        ],
        [
            '<tool_call>{"arguments": {}, "name": "x"}</tool_call>',
            '<tool_call>{"name": "x", "arguments": [1]}</tool_call>',
            '{"name": "x", "arguments": {}}',
            '<tool_call>{"name": "x", "arguments": {}}',
            '<tool_call>{"name": "1x", "arguments": {}}</tool_call>',
        ],
    ),
    "csv": (
        ["a,b,c\r\n1,2,3\r\n", 'name,quote\n"Smith, J","He said ""hi"""\n', "single", ',,\n"multi\nline",x'],
        ['a,"b', 'a,b"c', '"x"y,1', 'a,"b""'],
    ),
    "yaml_subset": (
        [
            "name: demo\nversion: 1.2\n",
            "---\nservers:\n  - alpha\n  - 'beta'\nconfig:\n  debug: true\n  paths:\n    - /usr\n    - \"/opt/x y\"\n",
            "- one\n- -2\n-\n  key: value\n",
            "empty:\nnext: x\n",
        ],
        [
            "name: demo",
            "name: a: b\n",
            "key:\n   - three spaces\n",
            "- [a, b]\n",
            "a:\n  b:\n    c:\n      d: too deep\n",
            "key: 'open\n",
        ],
    ),
}


def test_every_builtin_file_is_covered_and_has_a_header() -> None:
    names = sorted(p.stem for p in grammars_dir().glob("*.gbnf"))
    assert names == sorted(EXAMPLES)
    for name in names:
        first = (grammars_dir() / f"{name}.gbnf").read_text(encoding="utf-8").splitlines()[0]
        assert first.startswith("# "), name


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_builtin_loads_and_round_trips(name: str) -> None:
    grammar = Grammar.builtin(name)
    assert grammar.root == "root"
    assert Grammar.from_ebnf(str(grammar)) == grammar


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_builtin_examples_reference(name: str) -> None:
    grammar = Grammar.builtin(name)
    accepted, rejected = EXAMPLES[name]
    for text in accepted:
        assert_accepts(grammar, text, backend="reference")
    for text in rejected:
        assert_rejects(grammar, text, backend="reference")


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_builtin_examples_native(name: str) -> None:
    grammar = Grammar.builtin(name)
    accepted, rejected = EXAMPLES[name]
    for text in accepted:
        assert_accepts(grammar, text, backend="native")
    for text in rejected:
        assert_rejects(grammar, text, backend="native")


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_native_matcher_agrees_on_generated_strings(name: str) -> None:
    grammar = Grammar.builtin(name)
    for text in random_strings(grammar, 8, seed=11, max_depth=4, max_repeat=3):
        assert_accepts(grammar, text, backend="native")
        assert_prefix(grammar, text[: len(text) // 2], backend="native")
