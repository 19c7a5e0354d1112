"""Structured-output demo on the default model (SmolLM2-135M-Instruct, runs on CPU).

Every output below is constrained by a grammar while it is generated, so it always parses:
a Pydantic model, a JSON Schema, a regex, a list of choices, and an EBNF grammar.
Run with ``make demo`` (or ``.venv/bin/python examples/demo.py``).
"""

from __future__ import annotations

import json
import time
from typing import Literal

from pydantic import BaseModel, Field

from agent_infer import LLM, SamplingParams
from agent_infer.structured import StructuredOutput


class Book(BaseModel):
    title: str = Field(max_length=60)
    author: str = Field(max_length=40)
    year: int = Field(ge=1450, le=2030)
    genre: Literal["fiction", "science", "history", "poetry"]


def main() -> None:
    """Load the default model and run one request per kind of constraint."""
    start = time.perf_counter()
    llm = LLM()
    print(f"loaded {llm.engine.loaded.path.name} in {time.perf_counter() - start:.1f}s\n")

    ask = [{"role": "user", "content": "Recommend one classic novel. Answer in JSON."}]
    start = time.perf_counter()
    out = llm.chat(ask, SamplingParams(temperature=0.6, seed=1, max_tokens=128, structured=Book))[0]
    book = out.outputs[0].parsed
    print(f"[pydantic] {out.text}")
    print(f"           -> {book!r} ({len(out.token_ids)} tokens, {time.perf_counter() - start:.1f}s)\n")

    schema = {
        "type": "object",
        "properties": {
            "tool": {"enum": ["search", "calculator", "weather"]},
            "query": {"type": "string", "maxLength": 40},
        },
        "required": ["tool", "query"],
        "additionalProperties": False,
    }
    ask = [{"role": "user", "content": "Which tool answers 'weather in Oslo tomorrow'? Reply as JSON."}]
    out = llm.chat(ask, SamplingParams(temperature=0, max_tokens=64, structured=schema))[0]
    print(f"[json schema] {out.text} -> {json.loads(out.text)}\n")

    ask = [{"role": "user", "content": "What is today's date? Use YYYY-MM-DD."}]
    out = llm.chat(
        ask, SamplingParams(temperature=0, structured=StructuredOutput.regex(r"\d{4}-\d{2}-\d{2}"))
    )[0]
    print(f"[regex] {out.text}\n")

    ask = [{"role": "user", "content": "Is the sky green? Answer yes or no."}]
    out = llm.chat(ask, SamplingParams(temperature=0, structured=["yes", "no"]))[0]
    print(f"[choice] {out.text}\n")

    ask = [{"role": "user", "content": "Write a SQL query that lists the names of users older than 30."}]
    out = llm.chat(
        ask, SamplingParams(temperature=0, max_tokens=48, structured=StructuredOutput.builtin("sql_select"))
    )[0]
    print(f"[ebnf: sql_select] {out.text!r} (finish: {out.finish_reason})")


if __name__ == "__main__":
    main()
