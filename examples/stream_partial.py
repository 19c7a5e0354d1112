"""Streaming a partial object: ``generate_stream`` yields the object as its JSON grows.

Each partial holds only the fields that have arrived (strings grow, numbers appear once complete);
nested values are validated only once closed, and the last item is the full validated object.
Run with ``.venv/bin/python examples/stream_partial.py``.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from agent_infer import Client


class Step(BaseModel):
    action: str = Field(max_length=50)
    minutes: int = Field(ge=1, le=120)


class Recipe(BaseModel):
    title: str = Field(max_length=40)
    servings: int = Field(ge=1, le=12)
    steps: list[Step] = Field(max_length=3)


def main() -> None:
    """Print every partial recipe as it streams in."""
    client = Client()
    for partial in client.generate_stream("Write a short pancake recipe as JSON.", schema=Recipe):
        print(repr(partial))


if __name__ == "__main__":
    main()
