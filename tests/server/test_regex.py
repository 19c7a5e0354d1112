"""``structured_outputs.regex`` means what it means in vLLM (ECMAScript: ASCII ``\\d``, ``\\w``)."""

from __future__ import annotations

from typing import Any

import pytest
from server_harness import LiveServer, openai_client, server_fixture

from agent_infer.grammar import GrammarCompiler, GrammarMatcher, TokenizerInfo
from agent_infer.server.params import build_constraint
from agent_infer.server.protocol import ChatCompletionRequest
from agent_infer.structured import StructuredOutput

openai = pytest.importorskip("openai")

server = server_fixture()


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(TokenizerInfo.bytes_only())


def _server_accepts(compiler: GrammarCompiler, pattern: str, text: str) -> bool:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "structured_outputs": {"regex": pattern},
        }
    )
    structured = build_constraint(req).structured
    assert structured is not None
    return GrammarMatcher(compiler.compile(structured.to_grammar())).accept_string(text)


@pytest.mark.parametrize(
    ("pattern", "text", "accepted"),
    [
        (r"\d", "3", True),
        (r"\d", "\u0663", False),  # ARABIC-INDIC DIGIT THREE: a digit to Python's re, not to ECMAScript
        (r"\d", "\uff13", False),  # FULLWIDTH DIGIT THREE
        (r"\w+", "abc_09", True),
        (r"\w", "\u00e9", False),
        (r"\W", "\u00e9", True),
        (r"[\d]", "\u0663", False),  # inside a class too
        (r"\s", " ", True),
    ],
)
def test_server_regex_classes_are_ascii(
    compiler: GrammarCompiler, pattern: str, text: str, accepted: bool
) -> None:
    assert _server_accepts(compiler, pattern, text) is accepted


def test_python_api_keeps_python_semantics(compiler: GrammarCompiler) -> None:
    grammar = StructuredOutput.regex(r"\d").to_grammar()
    assert GrammarMatcher(compiler.compile(grammar)).accept_string("\u0663")


def test_regex_digit_over_http(server: LiveServer) -> None:
    client = openai_client(server)

    def create(pattern: str) -> Any:
        return client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "Give me a number."}],
            max_tokens=8,
            temperature=0,
            extra_body={"structured_outputs": {"regex": pattern}},
        )

    assert create(r"\d{3}").choices[0].message.content.isascii()
    # A digit that is not 0-9: only non-ASCII digits match, and vLLM's \d has none of them.
    with pytest.raises(openai.BadRequestError) as caught:
        create(r"[^\D0-9]")
    assert caught.value.body["param"] == "structured_outputs.regex"
    assert "empty" in caught.value.body["message"]
