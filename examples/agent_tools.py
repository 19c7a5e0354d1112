"""A two-tool agent loop: a calculator and a lookup table, ending in a validated answer.

``client.run`` calls the model, executes the tool calls it makes (in SmolLM2's case written in the
Hermes ``<tool_call>`` format and constrained by its grammar), feeds the results back, and stops
when the model calls ``final_result`` with an ``Answer``. Run with
``.venv/bin/python examples/agent_tools.py``.
"""

from __future__ import annotations

import ast
import operator

from pydantic import BaseModel, Field

from agent_infer import Client, tool

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
POPULATION_MILLIONS = {"france": 68, "japan": 124, "italy": 59, "canada": 40}


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("only + - * / on numbers are supported")


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression such as "12 * 7".

    Args:
        expression: The expression, with + - * / and numbers.
    """
    return str(_evaluate(ast.parse(expression, mode="eval")))


@tool
def population(country: str) -> str:
    """Population of a country in millions, from a lookup table.

    Args:
        country: Country name, e.g. "France".
    """
    try:
        return str(POPULATION_MILLIONS[country.strip().lower()])
    except KeyError:
        raise ValueError(f"no data for {country!r}; known: {', '.join(POPULATION_MILLIONS)}") from None


class Answer(BaseModel):
    answer: str = Field(max_length=80)


def main() -> None:
    """Run the loop on two questions and print what happened."""
    client = Client()
    for question in ("Use the calculator: 12 * 7", "How many people live in Canada, in millions?"):
        result = client.run(
            [
                {
                    "role": "system",
                    "content": "Use the tools to find facts, then give the answer with final_result.",
                },
                {"role": "user", "content": question},
            ],
            tools=[calculator, population],
            schema=Answer,
            max_turns=6,
            parallel_tool_calls=False,
        )
        print(f"Q: {question}")
        for message in result.transcript[2:]:
            for call in message.get("tool_calls") or []:
                print(f"   call {call['function']['name']}({call['function']['arguments']})")
            if message["role"] == "tool":
                print(f"   -> {message['content']}")
        print(f"A: {result.output!r}  ({result.turns} turns, {result.usage.total_tokens} tokens)\n")


if __name__ == "__main__":
    main()
