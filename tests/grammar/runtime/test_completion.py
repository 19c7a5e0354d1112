"""Shortest completions and closing tokens (GrammarMatcher.shortest_completion / closing_tokens).

Property checked on real documents: for every prefix of a valid document, the completion turns
the prefix into a complete string of the grammar, and it is never longer than the rest of that
document (which is one completion, so the shortest cannot be longer).
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from grammar_support import tokenizer_info
from shared_data import SHARED_DATA, require_shared_data

from agent_infer.grammar import Grammar, GrammarCompiler, GrammarMatcher

MASKBENCH = SHARED_DATA / "maskbench-dev"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2},
        "tags": {"type": "array", "items": {"type": "integer"}, "minItems": 2},
        "kind": {"enum": ["human", "robot"]},
        "home": {
            "type": "object",
            "properties": {"x": {"type": "number"}, "label": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["x", "label"],
        },
    },
    "required": ["name", "tags", "kind", "home"],
}
PERSON_DOC = (
    '{"name": "Ada Lovelace", "tags": [1815, 1852], "kind": "human", "home": {"x": -0.5e3, "label": "LDN"}}'
)


def _matcher(grammar: Grammar, name: str = "smollm2") -> GrammarMatcher:
    return GrammarMatcher(GrammarCompiler(tokenizer_info(name)).compile(grammar))


def _check_prefixes(grammar: Grammar, doc: str) -> list[bytes]:
    data = doc.encode()
    completions = []
    for cut in range(len(data) + 1):
        m = _matcher(grammar)
        assert m.accept_string(data[:cut]), f"prefix {data[:cut]!r} rejected"
        completion = m.shortest_completion()
        assert completion is not None
        assert len(completion) <= len(data) - cut, (data[:cut], completion)
        whole = _matcher(grammar)
        assert whole.accept_string(data[:cut] + completion) and whole.can_terminate(), (
            data[:cut],
            completion,
        )
        completions.append(completion)
    return completions


def test_json_schema_prefixes_complete_to_valid_documents() -> None:
    grammar = Grammar.from_json_schema(PERSON)
    completions = _check_prefixes(grammar, PERSON_DOC)
    data = PERSON_DOC.encode()
    for cut, completion in enumerate(completions):
        jsonschema.validate(json.loads(data[:cut] + completion), PERSON)
    # From the start: every required field with its minimal value, readable characters chosen.
    assert json.loads(completions[0]) == {
        "name": "aa",
        "tags": [0, 0],
        "kind": "human",
        "home": {"x": 0, "label": "AAA"},
    }
    assert completions[-1] == b""


@pytest.mark.parametrize(
    ("grammar", "doc"),
    [
        (Grammar.from_regex(r"(ab|c)+d{2,3}[0-9]{1,2}"), "ababccdd77"),
        (Grammar.builtin("json"), '{"a": [1, {"b": null}, "x\\u00e9y"], "c": -1.5e-3}'),
        (
            Grammar.from_ebnf('root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]+ | "(" expr ")"'),
            "((1+23)+(4))+5",
        ),
        (
            Grammar.from_ebnf('root ::= expr\nexpr ::= expr "*" atom | atom\natom ::= "x" | "(" expr ")"'),
            "((x*x)*x)",
        ),
    ],
    ids=["regex", "json", "arithmetic", "left-recursive"],
)
def test_other_front_ends(grammar: Grammar, doc: str) -> None:
    _check_prefixes(grammar, doc)


def test_minimal_lengths_are_exact() -> None:
    # Small cases whose shortest completion is known by hand.
    m = _matcher(Grammar.from_regex(r"abc(d|efg)"))
    assert m.shortest_completion() == b"abcd"
    m = _matcher(Grammar.from_ebnf('root ::= "(" root ")" | "x"'))
    assert m.accept_string("(((")
    assert m.shortest_completion() == b"x)))"


def test_terminated_and_finished_states() -> None:
    m = _matcher(Grammar.from_regex("ok"))
    assert m.accept_string("ok")
    assert m.shortest_completion() == b""
    info = m.compiled_grammar.tokenizer_info
    assert m.closing_tokens() == [info.eos_token_ids[0]]
    assert m.accept_token(info.eos_token_ids[0])
    assert m.shortest_completion() is None and m.closing_tokens() is None


@pytest.mark.parametrize("name", ["smollm2", "deepseek"])
def test_closing_tokens_spell_the_completion(name: str) -> None:
    grammar = Grammar.from_json_schema(PERSON)
    m = _matcher(grammar, name)
    assert m.accept_string('{"name": "Ad')
    info = m.compiled_grammar.tokenizer_info
    tokens = m.closing_tokens()
    assert tokens is not None and tokens[-1] == info.eos_token_ids[0]
    completion = m.shortest_completion()
    assert completion is not None
    assert b"".join(info.token_bytes(t) for t in tokens[:-1]) == completion
    # Canonical: the same ids the tokenizer produces for that text.
    assert tokens[:-1] == info.encode(completion.decode())
    for t in tokens:
        assert m.accept_token(t)
    assert m.is_terminated()


def test_closing_after_a_partial_character() -> None:
    info = tokenizer_info("smollm2")
    m = GrammarMatcher(GrammarCompiler(info).compile(Grammar.from_regex("(日本)+")))
    first = "日".encode()[:1]
    assert m.accept_token(next(t for t in range(info.vocab_size) if info.token_bytes(t) == first))
    tokens = m.closing_tokens()
    assert tokens is not None
    assert b"".join(info.token_bytes(t) for t in tokens[:-1]) == "日本".encode()[1:]
    for t in tokens:
        assert m.accept_token(t)
    assert m.is_terminated()


def test_maskbench_documents() -> None:
    require_shared_data("maskbench-dev")
    # Real-world schemas: every prefix (every 7th byte) of each valid instance up to 1,500 bytes completes to a
    # document that validates; 40 schemas in a fixed order.
    checked = 0
    for path in sorted(MASKBENCH.glob("*.json"))[::60]:
        doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        valid = [t["data"] for t in doc.get("tests", []) if t.get("valid")]
        try:
            grammar = Grammar.from_json_schema(doc["schema"], strict=True)
            compiled = GrammarCompiler(tokenizer_info("smollm2")).compile(grammar)
        except Exception:
            continue
        validator = jsonschema.validators.validator_for(doc["schema"])(doc["schema"])
        for value in valid[:2]:
            data = json.dumps(value).encode()
            if len(data) > 1500:
                continue  # long instances add time, not cases
            for cut in range(0, len(data) + 1, 7):
                m = GrammarMatcher(compiled)
                if not m.accept_string(data[:cut]):
                    break  # an instance the grammar rejects (e.g. format details) is not ours to check
                completion = m.shortest_completion()
                assert completion is not None and len(completion) <= len(data) - cut, (path.name, cut)
                text = data[:cut] + completion
                validator.validate(json.loads(text))
        checked += 1
    assert checked >= 30
