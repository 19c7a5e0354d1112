"""The front-end registry: ``Grammar.from_*`` reach the front ends registered by
``agent_infer.grammar.frontends``, and the IR package imports no other part of agent_infer."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import agent_infer.grammar.ir as ir_package
from agent_infer.errors import GrammarDefinitionError
from agent_infer.grammar.frontends.ebnf.gbnf import parse_gbnf
from agent_infer.grammar.ir import FRONTENDS, Grammar, register_frontend
from agent_infer.grammar.ir import grammar as grammar_module


def test_every_front_end_is_registered_and_reached() -> None:
    assert set(grammar_module._BUILDERS) == set(FRONTENDS)
    assert Grammar.from_ebnf('root ::= "a"+') == parse_gbnf('root ::= "a"+')
    assert Grammar.from_ebnf('start: "a"+', syntax="lark").rules
    assert Grammar.from_regex("a+").rule("root") == parse_gbnf('root ::= "a"+').rule("root")
    assert Grammar.from_json_schema({"const": 1}).rules


def test_unknown_and_missing_front_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown front end 'toml'"):
        register_frontend("toml", parse_gbnf)
    monkeypatch.delitem(grammar_module._BUILDERS, "regex")
    with pytest.raises(GrammarDefinitionError, match="the regex front end is not registered"):
        Grammar.from_regex("a")
    with pytest.raises(GrammarDefinitionError, match="unknown EBNF syntax"):
        Grammar.from_ebnf("x", syntax="peg")


def test_the_ir_imports_only_itself_and_errors() -> None:
    folder = Path(ir_package.__file__).parent
    for path in folder.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            for name in names:
                if name.startswith("agent_infer"):
                    assert name == "agent_infer.errors" or name.startswith("agent_infer.grammar.ir"), (
                        path.name,
                        name,
                    )
